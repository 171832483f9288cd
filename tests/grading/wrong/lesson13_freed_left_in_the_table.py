"""The freed blocks listed but left in the table: the table still names blocks that others may now take."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.remove_skipped_blocks"
MESSAGE = "the freed blocks are still in the table"


def remove_skipped_blocks(block_ids, num_computed_tokens, sliding_window, block_size, null_block=0):
    table = list(block_ids)
    count = min(max(0, num_computed_tokens - sliding_window + 1) // block_size, len(table))
    freed = []
    for i in range(count - 1, -1, -1):
        if table[i] == null_block:
            break
        freed.append(table[i])  # the mistake: the null block never takes its place
    return table, freed
