"""Lesson 09's rule unchanged: the watermark argument is never used."""

from paged_kv.grading.reference.lesson11 import *  # every other task stays right

BREAKS = "11.admit_with_watermark"
MESSAGE = "the watermark is ignored"


def admit_with_watermark(num_free_blocks, prompt_blocks, num_running, num_blocks, watermark):
    return prompt_blocks + num_running + 1 <= num_free_blocks  # the mistake: no blocks kept free
