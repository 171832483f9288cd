"""Headroom for the running requests only: one block kept back per running request, none for the new one."""

from paged_kv import blocks_for_tokens
from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.can_admit"
MESSAGE = "you kept one block of headroom per running request. vLLM keeps no block per running request"


def can_admit(num_free_blocks, prompt_tokens, num_running, block_size):
    return (
        blocks_for_tokens(prompt_tokens, block_size) + num_running <= num_free_blocks
    )  # the mistake: num_running does not count
