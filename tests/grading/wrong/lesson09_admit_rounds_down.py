"""The prompt's blocks rounded down: a 5-token prompt in blocks of 4 counted as 1 block, not 2."""

from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.can_admit"
MESSAGE = "the prompt's blocks are rounded down"


def can_admit(num_free_blocks, prompt_tokens, num_running, block_size):
    return prompt_tokens // block_size <= num_free_blocks  # the mistake: // rounds down
