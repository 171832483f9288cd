"""The watermark argument never used: only the prompt's blocks are counted, beside running requests too."""

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.admit_with_watermark"
MESSAGE = "the watermark is ignored"


def admit_with_watermark(num_free_blocks, prompt_blocks, num_running, num_blocks, watermark):
    return prompt_blocks <= num_free_blocks  # the mistake: no blocks kept free while others run
