"""The watermark taken as a fraction of the blocks free now instead of all the blocks."""

import math

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.admit_with_watermark"
MESSAGE = "not of the blocks free now"


def admit_with_watermark(num_free_blocks, prompt_blocks, num_running, num_blocks, watermark):
    keep_free = math.ceil(watermark * num_free_blocks) if num_running else 0  # the mistake: num_blocks
    return prompt_blocks + keep_free <= num_free_blocks
