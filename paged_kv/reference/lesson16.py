"""Exercise 16 graded on the package: ``cut_at_stop`` gives the text, as one token, to an
:class:`~paged_kv.serving.output_processor.OutputProcessor` with the stop strings (vLLM's
``check_stop_strings``: the first string of the list found ends the text, which is cut before it);
``sendable`` holds back :attr:`~paged_kv.serving.sampling_params.SamplingParams.stop_buffer_length`
characters of a running text after its trailing ``\\ufffd``, as the processor's streams do, and never
more than the text has; ``child_requests`` names the children as the processor does
(``child_request_ids``) and seeds them as :class:`~paged_kv.serving.llm_engine.LLMEngine` does (vLLM's
``ParentRequest.get_child_info``); ``abort`` frees each running request's table with
:class:`~paged_kv.core.single_type_kv_cache_manager.FullAttentionManager` (vLLM's
``SingleTypeKVCacheManager.free``: ref counts, the last block first) over a
:class:`~paged_kv.core.block_allocator.BlockAllocator` that holds the free list given.
"""

from collections import Counter as _Counter
from collections.abc import Hashable as _Hashable
from collections.abc import Sequence as _Sequence

from paged_kv.core.block_pool import BlockPool as _BlockPool
from paged_kv.core.kv_cache_groups import FullAttentionSpec as _FullAttentionSpec
from paged_kv.core.single_type_kv_cache_manager import FullAttentionManager as _FullAttentionManager
from paged_kv.serving.output_processor import OutputProcessor as _OutputProcessor
from paged_kv.serving.output_processor import child_request_ids as _child_request_ids
from paged_kv.serving.output_processor import child_seed as _child_seed
from paged_kv.serving.sampling_params import SamplingParams as _SamplingParams

__all__ = ["abort", "child_requests", "cut_at_stop", "sendable"]


def cut_at_stop(text: str, stop: _Sequence[str]) -> tuple[str, str | None]:
    """The text before the first stop string of the list found in it, and that string, else
    ``(text, None)``."""
    processor = _OutputProcessor(decode=lambda token_ids: text)
    processor.add_request("request", [0], _SamplingParams(stop=tuple(stop)))
    outputs, stopped = processor.process_outputs({"request": 0})
    if not stopped:
        return text, None
    completion = outputs[0].outputs[0]
    return completion.text, completion.stop_reason


def sendable(text: str, stop: _Sequence[str], finished: bool) -> str:
    """What a stream may send of ``text`` now: all of it once finished, else the text without its trailing
    ``\\ufffd`` and its last ``len(longest stop) - 1`` characters."""
    if finished:
        return text
    text = text.rstrip("\ufffd")
    hold = _SamplingParams(stop=tuple(stop)).stop_buffer_length
    return text[: max(len(text) - hold, 0)]


def child_requests(request_id: _Hashable, n: int, seed: int | None) -> list[tuple[_Hashable, int | None]]:
    """The core's requests for a request of ``n`` completions: ``(child_id, child_seed)`` each."""
    ids = _child_request_ids(request_id, n)
    if n == 1:
        return [(request_id, seed)]
    return [(child, _child_seed(seed, index)) for index, child in enumerate(ids)]


def abort(
    running: list,
    waiting: list,
    free_blocks: list[int],
    block_tables: dict,
    request_ids: _Sequence[_Hashable],
) -> list:
    """Finish ``request_ids`` in place (see the module); return those finished, in the order given."""
    table_ids = [b for table in block_tables.values() for b in table]
    ids = list(dict.fromkeys([*free_blocks, *table_ids]))
    pool_id = {block_id: index + 1 for index, block_id in enumerate(ids)}  # the pool's block 0 is null
    block_id_of = {index: block_id for block_id, index in pool_id.items()}
    pool = _BlockPool(len(ids) + 1)  # its block 0, the null block, taken already
    pool.get_new_blocks(len(ids))  # every block held; the free ones go back in their order
    for block_id in free_blocks:
        pool.free(pool_id[block_id])
    for block_id, holders in _Counter(table_ids).items():
        for _ in range(holders - 1):
            pool.add_ref(pool_id[block_id])
    manager = _FullAttentionManager(_FullAttentionSpec(block_size=1), pool, 0)
    for request_id, table in block_tables.items():
        manager.req_to_blocks[request_id] = [pool_id[b] for b in table]
    finished: list = []
    for request_id in request_ids:
        if request_id in finished:
            continue
        if request_id in running:
            manager.free(request_id)
            block_tables.pop(request_id, None)
            running.remove(request_id)
        elif request_id in waiting:
            waiting.remove(request_id)
        else:
            continue
        finished.append(request_id)
    free_blocks[:] = [block_id_of[b] for b in pool.free_block_ids]
    return finished
