"""A slot made for the first output token at admission: the blocks of prompt_tokens + 1 tokens."""

from paged_kv import blocks_for_tokens
from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.can_admit"
MESSAGE = "you made room for the first output token too"


def can_admit(num_free_blocks, prompt_tokens, num_running, block_size):
    return blocks_for_tokens(prompt_tokens + 1, block_size) <= num_free_blocks  # the mistake: + 1
