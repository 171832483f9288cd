"""The course's old rule whole: the prompt, one block of headroom per running sequence (the new one
included) and the watermark, kept even when nothing runs."""

import math

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.admit_with_watermark"
MESSAGE = "no block of headroom per running sequence"


def admit_with_watermark(num_free_blocks, prompt_blocks, num_running, num_blocks, watermark):
    keep_free = math.ceil(watermark * num_blocks)  # a second mistake: kept when nothing runs too
    return prompt_blocks + num_running + 1 + keep_free <= num_free_blocks  # the mistake: the headroom
