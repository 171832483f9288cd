"""The course's old rule: one block of headroom per running request, the new one included, besides the
prompt's blocks. vLLM keeps none: it admits into a full pool and preempts when a decode finds no block."""

from paged_kv import blocks_for_tokens
from paged_kv.reference.lesson09 import *  # every other task stays right

BREAKS = "09.can_admit"
MESSAGE = (
    "vLLM keeps no block per running request: it admits into a full pool and preempts when a decode "
    "finds no block"
)


def can_admit(num_free_blocks, prompt_tokens, num_running, block_size):
    headroom = num_running + 1  # the mistake: vLLM keeps no block for the next decode step
    return blocks_for_tokens(prompt_tokens, block_size) + headroom <= num_free_blocks
