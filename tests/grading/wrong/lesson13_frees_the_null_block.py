"""Every skipped entry freed, the null ones too: the null block is listed as freed again and again."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.remove_skipped_blocks"
MESSAGE = "the null block is never freed"


def remove_skipped_blocks(block_ids, num_computed_tokens, sliding_window, block_size, null_block=0):
    table = list(block_ids)
    count = min(max(0, num_computed_tokens - sliding_window + 1) // block_size, len(table))
    freed = []
    for i in range(count - 1, -1, -1):  # the mistake: no stop at the first null entry
        freed.append(table[i])
        table[i] = null_block
    return table, freed
