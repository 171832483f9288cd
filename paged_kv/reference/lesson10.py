"""Exercise 10 graded on the package.

``kv_bytes_per_token`` reads a Hugging Face config the way :class:`paged_kv.model.hf.HFCausalLM`
reads it for the cache (the K/V heads, ``num_attention_heads`` when ``num_key_value_heads`` is None
or missing; the head size, ``hidden_size // num_attention_heads`` when ``head_dim`` is None or
missing) and returns what :class:`paged_kv.kv.sizing.KVCacheSpec` says one token costs, in a dtype
of ``bytes_per_number`` bytes. ``schedule_step`` is the token budget's pass of
:meth:`paged_kv.serving.scheduler.Scheduler.schedule` when memory is not the limit: the running
requests in list order, each ``min(num_tokens - num_computed_tokens, budget left)``, then the
waiting ones in queue order, each ``min(prompt tokens, budget left)``, admission stopping when the
budget is spent (the scheduler's running pass and its admission, which build
``SchedulerOutput.num_scheduled_tokens``); the budget is checked as the scheduler checks it
(:func:`~paged_kv.serving.scheduler.check_budget`). ``first_token_steps`` finds what
:class:`~paged_kv.serving.engine.EngineResult` records as ``first_token_step``: the step whose chunk
completes the prompt, the first step whose ``ModelRunnerOutput.sampled_token_ids`` holds a token for the
request.
"""

from collections.abc import Hashable as _Hashable
from collections.abc import Iterable as _Iterable
from collections.abc import Mapping as _Mapping
from collections.abc import Sequence as _Sequence

import torch as _torch

from paged_kv.kv.sizing import KVCacheSpec as _KVCacheSpec
from paged_kv.serving.scheduler import check_budget as _check_budget

__all__ = ["first_token_steps", "kv_bytes_per_token", "schedule_step"]

# A floating point dtype of each size, for KVCacheSpec, which counts the bytes of a dtype.
_DTYPES = {
    dtype.itemsize: dtype for dtype in (_torch.float8_e4m3fn, _torch.bfloat16, _torch.float32, _torch.float64)
}


def kv_bytes_per_token(config: object, bytes_per_number: int) -> int:
    """K and V of one token over all layers: ``2 * layers * kv_heads * head_dim * bytes_per_number``."""
    num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    dtype = _DTYPES.get(bytes_per_number)
    if dtype is None:  # a size no floating point dtype has: the numbers in float32, then their bytes
        numbers = _KVCacheSpec(
            config.num_hidden_layers, num_kv_heads, head_dim, _torch.float32
        ).bytes_per_token
        return numbers // _torch.float32.itemsize * bytes_per_number
    return _KVCacheSpec(config.num_hidden_layers, num_kv_heads, head_dim, dtype).bytes_per_token


def schedule_step(
    running: _Sequence[tuple[_Hashable, int]],
    waiting: _Sequence[tuple[_Hashable, int]],
    budget: int | None,
) -> list[tuple[_Hashable, int]]:
    """One step's ``(request_id, tokens)``: running first, then the queue, under ``budget`` (None: none)."""
    left = _check_budget(budget)
    scheduled = []
    for requests in (running, waiting):
        for request_id, wanted in requests:
            if left == 0:  # the budget is spent: nobody else runs, admission stops
                break
            n = wanted if left is None else min(wanted, left)
            scheduled.append((request_id, n))
            left = None if left is None else left - n
    return scheduled


def first_token_steps(
    scheduled_tokens: _Iterable[_Iterable[tuple[_Hashable, int]]], prompt_lens: _Mapping[_Hashable, int]
) -> dict[_Hashable, int]:
    """Per request, the step whose chunk brings its scheduled tokens to its prompt's length."""
    computed = dict.fromkeys(prompt_lens, 0)
    found: dict[_Hashable, int] = {}
    for step, scheduled in enumerate(scheduled_tokens):
        for request_id, n in scheduled:
            computed[request_id] += n
            if request_id not in found and computed[request_id] >= prompt_lens[request_id]:
                found[request_id] = step
    return found
