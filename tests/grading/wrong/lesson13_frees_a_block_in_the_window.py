"""The skipped blocks rounded up: the block that still holds the window's first position is freed too."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.remove_skipped_blocks"
MESSAGE = "you freed a block that still holds a position in the window"


def remove_skipped_blocks(block_ids, num_computed_tokens, sliding_window, block_size, null_block=0):
    table = list(block_ids)
    skipped = max(0, num_computed_tokens - sliding_window + 1)
    count = min(-(-skipped // block_size), len(table))  # the mistake: ceil, not floor
    freed = []
    for i in range(count - 1, -1, -1):
        if table[i] == null_block:
            break
        freed.append(table[i])
        table[i] = null_block
    return table, freed
