"""The right blocks freed first to last: vLLM frees them from the last skipped block down."""

from paged_kv.reference.lesson13 import *  # every other task stays right

BREAKS = "13.remove_skipped_blocks"
MESSAGE = "the right blocks in the wrong order"


def remove_skipped_blocks(block_ids, num_computed_tokens, sliding_window, block_size, null_block=0):
    table = list(block_ids)
    count = min(max(0, num_computed_tokens - sliding_window + 1) // block_size, len(table))
    freed = []
    for i in range(count):  # the mistake: walks forward
        if table[i] != null_block:
            freed.append(table[i])
            table[i] = null_block
    return table, freed
