"""The watermark kept even when nothing runs: a request alone, such as one resumed by recompute whose
prompt now holds its output too, can be refused for ever by a pool that would hold it."""

import math

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.admit_with_watermark"
MESSAGE = "the watermark is kept only while another request runs"


def admit_with_watermark(num_free_blocks, prompt_blocks, num_running, num_blocks, watermark):
    keep_free = math.ceil(watermark * num_blocks)  # the mistake: vLLM keeps it only beside running requests
    return prompt_blocks + keep_free <= num_free_blocks
