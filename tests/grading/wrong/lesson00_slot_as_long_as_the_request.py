"""Giving each request a contiguous slot as long as itself instead of as long as the longest request."""

from paged_kv.reference.lesson00 import *  # every other task stays right

BREAKS = "00.contiguous_usage"
MESSAGE = "as long as the longest one"


def contiguous_usage(request_tokens: list[int], slot_tokens: int | None = None) -> dict:
    held = sum(request_tokens)
    reserved = held if slot_tokens is None else slot_tokens * len(request_tokens)
    return {
        "reserved_tokens": reserved,
        "internal_fragmentation_tokens": reserved - held,
        "utilization": held / reserved if reserved else 0.0,
    }
