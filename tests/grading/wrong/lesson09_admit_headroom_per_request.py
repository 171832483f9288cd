"""No headroom at all: a request is admitted as soon as its prompt fits, as in lesson 04's scheduler."""

from paged_kv import blocks_for_tokens
from paged_kv.grading.reference.lesson09 import *  # every other task stays right

BREAKS = "09.can_admit"
MESSAGE = "no headroom at all"


def can_admit(num_free_blocks, prompt_tokens, num_running, block_size):
    return (
        blocks_for_tokens(prompt_tokens, block_size) <= num_free_blocks
    )  # the mistake: the next step is ignored
