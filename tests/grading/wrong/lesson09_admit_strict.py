"""A strict comparison: a request that needs exactly the free blocks is refused."""

from paged_kv import blocks_for_tokens
from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.can_admit"
MESSAGE = "compare with <=, not <"


def can_admit(num_free_blocks, prompt_tokens, num_running, block_size):
    return blocks_for_tokens(prompt_tokens, block_size) < num_free_blocks  # the mistake: <
