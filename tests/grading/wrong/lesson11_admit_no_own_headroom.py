"""Headroom for the running sequences only: the new one gets none, though it decodes next step too."""

import math

from paged_kv.grading.reference.lesson11 import *  # every other task stays right

BREAKS = "11.admit_with_watermark"
MESSAGE = "no headroom of its own"


def admit_with_watermark(num_free_blocks, prompt_blocks, num_running, num_blocks, watermark):
    keep_free = math.ceil(watermark * num_blocks)
    return prompt_blocks + num_running + keep_free <= num_free_blocks  # the mistake: num_running + 1
