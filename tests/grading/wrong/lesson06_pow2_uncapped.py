"""The power-of-two slot not capped at max_model_len: 300 tokens reserve 512 slots though none is over 400."""

from paged_kv.grading.reference.lesson06 import *  # every other task stays right
from paged_kv.grading.reference.lesson06 import reserved_tokens as right_reserved_tokens

BREAKS = "06.reserved_tokens"
MESSAGE = "cap the power of two at max_model_len"


def reserved_tokens(kind, prompt_tokens, output_tokens, max_model_len):
    if kind == "pow2":
        return next_power_of_two(prompt_tokens + output_tokens)  # the mistake: no min(..., max_model_len)
    return right_reserved_tokens(kind, prompt_tokens, output_tokens, max_model_len)
