"""The power of two of the whole final length, not of the output alone: 300 + 1 tokens reserve 512 slots."""

from paged_kv.reference.lesson07 import *  # every other task stays right
from paged_kv.reference.lesson07 import reserved_tokens as right_reserved_tokens

BREAKS = "07.reserved_tokens"
MESSAGE = "rounds only the output"


def reserved_tokens(kind, prompt_tokens, output_tokens, max_model_len):
    if kind == "pow2":  # the mistake: the prompt, whose length is known, is rounded up with the output
        return min(next_power_of_two(prompt_tokens + output_tokens), max_model_len)
    return right_reserved_tokens(kind, prompt_tokens, output_tokens, max_model_len)
