"""A strict comparison: a prompt that takes exactly the free blocks (the watermark's kept) waits."""

import math

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.admit_with_watermark"
MESSAGE = "compare with <=, not <"


def admit_with_watermark(num_free_blocks, prompt_blocks, num_running, num_blocks, watermark):
    keep_free = math.ceil(watermark * num_blocks) if num_running else 0
    return prompt_blocks + keep_free < num_free_blocks  # the mistake: exactly enough is enough
