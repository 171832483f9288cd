"""Headroom for the running sequences only: the request being admitted gets none of its own."""

from paged_kv import blocks_for_tokens
from paged_kv.grading.reference.lesson09 import *  # every other task stays right

BREAKS = "09.can_admit"
MESSAGE = "no headroom of its own"


def can_admit(num_free_blocks, prompt_tokens, num_running, block_size):
    return (
        blocks_for_tokens(prompt_tokens, block_size) + num_running <= num_free_blocks
    )  # the mistake: no + 1
