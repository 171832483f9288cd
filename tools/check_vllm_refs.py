"""Check the course's citations of vLLM against a vLLM source tree (run by hand, not by CI).

Every lesson says where its concept lives in vLLM ("In vLLM" sections), and docs/glossary.md gives
vLLM's name for each term. Both cite files as backticked paths, ``vllm/v1/core/block_pool.py``, with
backticked names beside them, ``BlockPool``, ``get_new_blocks``. This script finds every such
citation and checks, against the tree given (default ``/work/vllm-0.33.0``, the version the course
is checked against), that

* every cited ``vllm/....py`` path exists, and
* every backticked name in the same passage is defined in one of the passage's cited files:
  ``def name``, ``class name``, ``name =`` or ``name: ...`` (an attribute, a field, a parameter, an
  enum member), an import of it, or a use as an attribute (``scheduler_config.max_num_seqs``: a
  setting the file reads). A dotted name, ``FlashAttentionImpl.forward``, needs each of its parts defined.

A passage is a markdown bullet (with its continuation lines), a paragraph, or one cell of a table
row; only passages that cite a path are checked. A name preceded by "course's", "package's",
"lesson's" or "our" (this course's ``BlockAllocator``), or followed by "here" (``allocate_prompt``
here),
names this course's code and is not looked up; nor are Python's builtins
(``None``, ``ValueError``) and backticked spans that are not plain names (shapes, expressions, calls
with arguments). The check is a grep, not an import: a
name it accepts is defined somewhere in the file, which catches renamed and removed names, not a
name cited for the wrong class.

Usage:
    python tools/check_vllm_refs.py                       check course/ and docs/glossary.md
    python tools/check_vllm_refs.py --vllm /path/to/vllm  against another tree
    python tools/check_vllm_refs.py FILE ...              check only these files

It prints one line per problem, ``file:line: ...``, and exits 1 when there is any (2 when the tree
or a file given is missing).
"""

from __future__ import annotations

import argparse
import builtins
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_VLLM = Path("/work/vllm-0.33.0")
BACKTICKED = re.compile(r"`([^`\n]+)`")
VLLM_PATH = re.compile(r"^vllm/[\w./-]+\.py$")
NAME = re.compile(r"^[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*(?:\(\))?$")
COURSE_NAME = re.compile(r"(?:(?:course|package|lesson)'s|\bour)\s*$")
COURSE_NAME_AFTER = re.compile(r"^\s*here\b")
NOT_NAMES = frozenset(dir(builtins))  # None, True, ValueError, int: not vLLM's names
BULLET = re.compile(r"^\s*(?:[*-]|\d+\.)\s")
SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[A-Z`(*]|vLLM)")


@dataclass(frozen=True)
class Citation:
    """One passage that cites vLLM: where it is, the files it names and the names beside them."""

    source: str
    line: int
    paths: tuple[str, ...]
    names: tuple[str, ...]


def passages(text: str) -> list[tuple[int, str]]:
    """Split markdown into passages, each with the number of its first line (1-based).

    A bullet (the "In vLLM" form: one bullet per file) runs until the next bullet, a blank line or
    a heading; a paragraph of prose gives one passage per sentence; a heading is a passage of its
    own; a table row gives one passage per cell.
    """
    found: list[tuple[int, str]] = []
    start, lines = 0, []

    def close() -> None:
        if not lines:
            return
        passage = "\n".join(lines)
        if BULLET.match(lines[0]):
            found.append((start, passage))
            return
        at = 0
        for sentence in SENTENCE_END.split(passage):
            at = passage.index(sentence, at)
            found.append((start + passage.count("\n", 0, at), sentence))

    for number, line in enumerate(text.splitlines(), start=1):
        stripped = line.strip()
        if not stripped or stripped.startswith("|") or line.startswith("#") or BULLET.match(line):
            close()
            lines = []
        if stripped.startswith("|"):
            found.extend((number, cell) for cell in stripped.strip("|").split("|"))
        elif line.startswith("#"):
            found.append((number, line))
        elif stripped:
            if not lines:
                start = number
            lines.append(line)
    close()
    return found


def citations(text: str, source: str, first_line: int = 1) -> list[Citation]:
    """The passages of ``text`` that cite at least one ``vllm/....py`` path.

    ``first_line`` is the line of ``source`` where ``text`` starts, for the line numbers reported.
    """
    found = []
    for line, passage in passages(text):
        paths, names = [], []
        for match in BACKTICKED.finditer(passage):
            span = match.group(1).strip()
            if VLLM_PATH.match(span):
                paths.append(span)
            elif _is_vllm_name(span, passage[: match.start()], passage[match.end() :]):
                names.append(span.removesuffix("()"))
        if paths:
            found.append(
                Citation(
                    source, line + first_line - 1, tuple(dict.fromkeys(paths)), tuple(dict.fromkeys(names))
                )
            )
    return found


def _is_vllm_name(span: str, before: str, after: str) -> bool:
    """Whether a backticked span is a plain name to look up: not a course's name, not a builtin."""
    return (
        bool(NAME.match(span))
        and span not in NOT_NAMES
        and not COURSE_NAME.search(before)
        and not COURSE_NAME_AFTER.match(after)
    )


def is_defined(name: str, code: str) -> bool:
    """Whether every part of the (possibly dotted) ``name`` is defined somewhere in ``code``."""
    return all(_defines(part, code) for part in name.split("."))


def _defines(part: str, code: str) -> bool:
    word = re.escape(part)
    patterns = (
        rf"^\s*(?:async\s+)?def\s+{word}\b",  # a function or method
        rf"^\s*class\s+{word}\b",  # a class
        rf"\b{word}\s*(?::[^=\n]+)?=(?!=)",  # an assignment, an attribute, an annotated field
        rf"^\s*{word}\s*[:,]",  # a field or parameter on its own line
        rf"[(,]\s*{word}\s*[:,)=]",  # a parameter inline
        rf"^\s*(?:from\s+\S+\s+)?import\s+[^\n]*\b{word}\b",  # an import
        rf"\w\.{word}\b",  # read as an attribute
    )
    return any(re.search(pattern, code, re.MULTILINE) for pattern in patterns)


def problems(found: Sequence[Citation], vllm_root: Path) -> list[str]:
    """One line per missing path or undefined name, ``source:line: ...``; empty when all are found."""
    lines = []
    for citation in found:
        where = f"{citation.source}:{citation.line}"
        codes = []
        for path in citation.paths:
            file = vllm_root / path
            if file.is_file():
                codes.append(file.read_text(encoding="utf-8", errors="replace"))
            else:
                lines.append(f"{where}: `{path}` does not exist")
        if not codes:
            continue
        for name in citation.names:
            if not any(is_defined(name, code) for code in codes):
                lines.append(f"{where}: `{name}` is not defined in {', '.join(citation.paths)}")
    return lines


def markdown_of(path: Path) -> list[tuple[int, str]]:
    """A file's markdown as ``(first line, text)`` pieces: a lesson source's markdown cells, with
    their ``# `` prefixes removed, or the whole of any other file."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".py":
        return [(1, text)]
    from tools.build_course import parse_percent

    return [
        (c.line_number + 1, "\n".join(c.lines))
        for c in parse_percent(text, path.name)
        if c.kind == "markdown"
    ]


def default_files(root: Path) -> list[Path]:
    """The course's sources and the glossary, the files that cite vLLM."""
    return [*sorted((root / "course").glob("*.py")), root / "docs" / "glossary.md"]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*", type=Path, help="files to check (default: course/, the glossary)")
    parser.add_argument("--vllm", type=Path, default=DEFAULT_VLLM, help="the vLLM source tree")
    args = parser.parse_args(argv)
    if not (args.vllm / "vllm").is_dir():
        print(f"no vLLM source tree at {args.vllm} (it must contain vllm/)", file=sys.stderr)
        return 2
    files = args.files or [f for f in default_files(ROOT) if f.exists()]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        print(f"no such file: {', '.join(missing)}", file=sys.stderr)
        return 2
    found = [c for f in files for first, text in markdown_of(f) for c in citations(text, _shown(f), first)]
    report = problems(found, args.vllm)
    for line in report:
        print(line)
    names = sum(len(c.names) for c in found)
    print(f"{len(found)} passages citing vLLM, {names} names: {len(report)} not found", file=sys.stderr)
    return 1 if report else 0


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(ROOT))
    except ValueError:
        return str(path)


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
