"""A contiguous slot reserved for the prompt alone, as if it could grow while the request decodes."""

from paged_kv.reference.lesson07 import *  # every other task stays right
from paged_kv.reference.lesson07 import reserved_tokens as right_reserved_tokens

BREAKS = "07.reserved_tokens"
MESSAGE = "not for the prompt alone"


def reserved_tokens(kind, prompt_tokens, output_tokens, max_model_len):
    return right_reserved_tokens(kind, prompt_tokens, 0, max_model_len)  # the mistake: the output is left out
