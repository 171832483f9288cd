"""Computing the utilization as held / reserved even when nothing is reserved, a ZeroDivisionError."""

from paged_kv.reference.lesson00 import *  # every other task stays right

BREAKS = "00.paged_usage"
MESSAGE = "avoid dividing by zero"


def paged_usage(request_tokens: list[int], block_size: int) -> dict:
    used_blocks = sum(blocks_for_tokens(tokens, block_size) for tokens in request_tokens)
    reserved = used_blocks * block_size
    held = sum(request_tokens)
    return {
        "used_blocks": used_blocks,
        "reserved_tokens": reserved,
        "internal_fragmentation_tokens": reserved - held,
        "block_utilization": held / reserved,
    }
