"""The scores scaled by 1 / head_dim instead of 1 / sqrt(head_dim)."""

from paged_kv.reference.lesson05 import *  # every other task stays right
from paged_kv.reference.lesson05 import decode_attention as right_decode_attention

BREAKS = "05.decode_attention"
MESSAGE = "the scores are scaled by 1 / head_dim"


def decode_attention(q, k, v, scale=None):
    scale = 1 / q.shape[-1] if scale is None else scale  # the mistake: head_dim ** -1, not head_dim ** -0.5
    return right_decode_attention(q, k, v, scale)
