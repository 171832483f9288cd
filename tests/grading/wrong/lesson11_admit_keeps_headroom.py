"""The old rule's headroom kept: one block per running sequence, the new one included, on top of the
prompt. vLLM keeps none; it admits when the prompt fits and preempts when a decode finds no block."""

import math

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.admit_with_watermark"
MESSAGE = "no block of headroom per running sequence"


def admit_with_watermark(num_free_blocks, prompt_blocks, num_running, num_blocks, watermark):
    keep_free = math.ceil(watermark * num_blocks) if num_running else 0
    return prompt_blocks + num_running + 1 + keep_free <= num_free_blocks  # the mistake: + num_running + 1
