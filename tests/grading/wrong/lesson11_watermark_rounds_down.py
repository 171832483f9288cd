"""The watermark rounded down: 1 % of 50 blocks is half a block, and int() keeps none of them free."""

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.admit_with_watermark"
MESSAGE = "the watermark is rounded down"


def admit_with_watermark(num_free_blocks, prompt_blocks, num_running, num_blocks, watermark):
    keep_free = int(watermark * num_blocks) if num_running else 0  # the mistake: int() rounds down
    return prompt_blocks + keep_free <= num_free_blocks
