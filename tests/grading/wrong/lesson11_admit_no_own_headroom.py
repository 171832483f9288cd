"""A block of headroom per running sequence, though not for the new one: half of the old rule, which
vLLM never had. It admits into a pool that may run short next step, and preempts then."""

import math

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.admit_with_watermark"
MESSAGE = "no block of headroom per running sequence"


def admit_with_watermark(num_free_blocks, prompt_blocks, num_running, num_blocks, watermark):
    keep_free = math.ceil(watermark * num_blocks) if num_running else 0
    return prompt_blocks + num_running + keep_free <= num_free_blocks  # the mistake: + num_running
