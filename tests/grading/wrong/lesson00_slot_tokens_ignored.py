"""Always sizing the contiguous slot by the longest request, ignoring a slot_tokens that is given."""

from paged_kv.reference.lesson00 import *  # every other task stays right

BREAKS = "00.contiguous_usage"
MESSAGE = "when slot_tokens is given"


def contiguous_usage(request_tokens: list[int], slot_tokens: int | None = None) -> dict:
    slot = max(request_tokens, default=0)
    reserved = slot * len(request_tokens)
    held = sum(request_tokens)
    return {
        "reserved_tokens": reserved,
        "internal_fragmentation_tokens": reserved - held,
        "utilization": held / reserved if reserved else 0.0,
    }
