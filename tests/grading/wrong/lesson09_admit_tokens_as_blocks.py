"""The prompt's tokens compared with the free blocks, as if a block held one token."""

from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.can_admit"
MESSAGE = "you compared tokens with blocks"


def can_admit(num_free_blocks, prompt_tokens, num_running, block_size):
    return prompt_tokens <= num_free_blocks  # the mistake: tokens are not blocks
