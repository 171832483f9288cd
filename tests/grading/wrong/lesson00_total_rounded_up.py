"""Rounding up the total of all requests' tokens, as if requests shared blocks, instead of each request."""

from paged_kv.reference.lesson00 import *  # every other task stays right

BREAKS = "00.paged_usage"
MESSAGE = "not blocks_for_tokens of the total"


def paged_usage(request_tokens: list[int], block_size: int) -> dict:
    held = sum(request_tokens)
    used_blocks = blocks_for_tokens(held, block_size)
    reserved = used_blocks * block_size
    return {
        "used_blocks": used_blocks,
        "reserved_tokens": reserved,
        "internal_fragmentation_tokens": reserved - held,
        "block_utilization": held / reserved if reserved else 0.0,
    }
