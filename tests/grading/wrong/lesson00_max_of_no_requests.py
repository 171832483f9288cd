"""Defaulting the slot to max(request_tokens), which raises ValueError when there are no requests."""

from paged_kv.reference.lesson00 import *  # every other task stays right

BREAKS = "00.contiguous_usage"
MESSAGE = "max([]) fails"


def contiguous_usage(request_tokens: list[int], slot_tokens: int | None = None) -> dict:
    slot = max(request_tokens) if slot_tokens is None else slot_tokens
    reserved = slot * len(request_tokens)
    held = sum(request_tokens)
    return {
        "reserved_tokens": reserved,
        "internal_fragmentation_tokens": reserved - held,
        "utilization": held / reserved if reserved else 0.0,
    }
