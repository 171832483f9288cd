"""A request of exactly max_model_len tokens refused: >= where > belongs."""

from paged_kv.reference.lesson07 import *  # every other task stays right
from paged_kv.reference.lesson07 import reserved_tokens as right_reserved_tokens

BREAKS = "07.reserved_tokens"
MESSAGE = "(>, not >=)"


def reserved_tokens(kind, prompt_tokens, output_tokens, max_model_len):
    if prompt_tokens + output_tokens >= max_model_len:  # the mistake: a request of exactly max_model_len fits
        raise ValueError(f"the request is longer than max_model_len ({max_model_len})")
    return right_reserved_tokens(kind, prompt_tokens, output_tokens, max_model_len)
