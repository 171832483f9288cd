"""tools/check_vllm_refs.py: finding the course's citations of vLLM and checking them against a tree.

The real tree (vLLM 0.33.0's sources) is not in CI, so these tests build a small fake one.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tools import check_vllm_refs
from tools.check_vllm_refs import Citation, citations, is_defined, passages, problems

POOL = '''\
class BlockPool:
    """Blocks."""

    def __init__(self, num_gpu_blocks: int):
        self.free_block_queue = make_queue()
        self.null_block = None

    async def get_new_blocks(self, num_blocks):
        return []


@dataclass
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0


def kernel(
    output_ptr,
    stride_k_cache_0: int,
):
    physical_block_idx = load(output_ptr)
    if physical_block_idx == 0:
        pass
'''


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    file = tmp_path / "vllm" / "v1" / "core" / "block_pool.py"
    file.parent.mkdir(parents=True)
    file.write_text(POOL)
    return tmp_path


@pytest.mark.parametrize(
    "name",
    [
        "BlockPool",  # a class
        "get_new_blocks",  # an async method
        "free_block_queue",  # an attribute set in __init__
        "ref_cnt",  # an annotated field with a default
        "block_id",  # an annotated field without one
        "num_gpu_blocks",  # a parameter inline
        "output_ptr",  # a parameter on its own line
        "stride_k_cache_0",  # an annotated parameter on its own line
        "physical_block_idx",  # a local variable
        "BlockPool.get_new_blocks",  # a dotted name: every part is defined
    ],
)
def test_is_defined_finds_every_kind_of_definition(name):
    assert is_defined(name, POOL)


@pytest.mark.parametrize(
    "name",
    [
        "get_num_free_blocks",  # not there at all
        "BlockPool.popleft",  # the class is there, the method is not
        "Block",  # only a prefix of names that are there
        "load",  # called, never defined
        "dataclass",  # a decorator used, not defined
    ],
)
def test_is_defined_refuses_names_only_used_or_absent(name):
    assert not is_defined(name, POOL)


def test_a_comparison_is_not_an_assignment():
    assert not is_defined("x", "if x == 0:\n    pass\n")
    assert is_defined("x", "x = 0\n")


def test_passages_are_bullets_sentences_headings_and_table_cells():
    text = textwrap.dedent(
        """\
        ## In vLLM
        One sentence here. Another one
        on two lines.

        * a bullet
          continued
        * a second bullet
        | a | b |
        """
    )
    assert passages(text) == [
        (1, "## In vLLM"),
        (2, "One sentence here."),
        (2, "Another one\non two lines."),
        (5, "* a bullet\n  continued"),
        (7, "* a second bullet"),
        (8, " a "),
        (8, " b "),
    ]


def test_citations_take_paths_and_plain_names_but_not_the_course_names_or_expressions():
    text = (
        "* `vllm/v1/core/block_pool.py`: `BlockPool`, `get_new_blocks()`, `free_blocks(blocks)`,\n"
        "  `(2, num_blocks)`, `None` and `ValueError`; this course's `BlockAllocator`.\n"
        "\n"
        "A sentence with `BlockTable` and no path.\n"
    )
    assert citations(text, "lesson.py", first_line=10) == [
        Citation("lesson.py", 10, ("vllm/v1/core/block_pool.py",), ("BlockPool", "get_new_blocks"))
    ]


def test_a_prose_sentence_keeps_only_its_own_names():
    text = "The course keeps `k_cache`. vLLM keeps `BlockPool` in `vllm/v1/core/block_pool.py`."
    (citation,) = citations(text, "x.md")
    assert citation.names == ("BlockPool",)


def test_problems_name_missing_files_and_undefined_names(tree):
    found = [
        Citation("a.md", 3, ("vllm/v1/core/block_pool.py",), ("BlockPool", "get_num_free_blocks")),
        Citation("a.md", 7, ("vllm/v1/core/gone.py",), ("Anything",)),
        Citation("a.md", 9, ("vllm/v1/core/gone.py", "vllm/v1/core/block_pool.py"), ("ref_cnt",)),
    ]
    assert problems(found, tree) == [
        "a.md:3: `get_num_free_blocks` is not defined in vllm/v1/core/block_pool.py",
        "a.md:7: `vllm/v1/core/gone.py` does not exist",
        "a.md:9: `vllm/v1/core/gone.py` does not exist",
    ]


def test_main_checks_a_lesson_source_and_a_glossary_and_reports_the_source_lines(tree, tmp_path, capsys):
    lesson = tmp_path / "01_x.lesson.py"
    lesson.write_text(
        "# %%\nimport torch\n\n# %% [markdown]\n# ## In vLLM\n#\n"
        "# * `vllm/v1/core/block_pool.py`: `BlockPool` and `popleft`\n"
    )
    glossary = tmp_path / "glossary.md"
    glossary.write_text(
        "| term | vLLM |\n|---|---|\n| block | `KVCacheBlock` (`vllm/v1/core/block_pool.py`) |\n"
    )
    assert check_vllm_refs.main([str(lesson), str(glossary), "--vllm", str(tree)]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out == [f"{lesson}:7: `popleft` is not defined in vllm/v1/core/block_pool.py"]


def test_main_passes_when_everything_is_found(tree, tmp_path, capsys):
    glossary = tmp_path / "glossary.md"
    glossary.write_text("* `vllm/v1/core/block_pool.py`: `BlockPool`, `KVCacheBlock.ref_cnt`\n")
    assert check_vllm_refs.main([str(glossary), "--vllm", str(tree)]) == 0
    assert capsys.readouterr().out == ""


def test_main_without_a_tree_says_so(tmp_path, capsys):
    assert check_vllm_refs.main(["--vllm", str(tmp_path / "nowhere")]) == 2
    assert "no vLLM source tree" in capsys.readouterr().err


def test_main_refuses_a_file_that_does_not_exist(tree, tmp_path, capsys):
    assert check_vllm_refs.main([str(tmp_path / "nothing.md"), "--vllm", str(tree)]) == 2
    assert "no such file" in capsys.readouterr().err


def test_a_name_imported_or_read_as_an_attribute_is_in_the_file():
    code = "from collections import deque\n\nlimit = self.scheduler_config.max_num_seqs\n"
    assert is_defined("deque", code) and is_defined("max_num_seqs", code)
    assert not is_defined("scheduler_config", "max_num_seqs = 1\n")


def test_the_course_names_beside_a_citation_are_not_looked_up():
    text = (
        "* `vllm/v1/core/block_pool.py`: `get_cached_block` (`PrefixCache.match` here), this"
        " lesson's `CachingBlockAllocator`, the package's `FreeKVCacheBlockQueue` and our `choose_victims`;"
        " `BlockPool` is here.\n"
    )
    (citation,) = citations(text, "lesson.py")
    assert citation.names == ("get_cached_block", "BlockPool")
