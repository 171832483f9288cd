"""The power-of-two room not capped at max_model_len: 150 + 200 tokens reserve 406 slots, over 400."""

from paged_kv.reference.lesson07 import *  # every other task stays right
from paged_kv.reference.lesson07 import reserved_tokens as right_reserved_tokens

BREAKS = "07.reserved_tokens"
MESSAGE = "cap the reservation at max_model_len"


def reserved_tokens(kind, prompt_tokens, output_tokens, max_model_len):
    if kind == "pow2":
        return prompt_tokens + next_power_of_two(output_tokens)  # the mistake: no min(..., max_model_len)
    return right_reserved_tokens(kind, prompt_tokens, output_tokens, max_model_len)
