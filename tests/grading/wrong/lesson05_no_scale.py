"""The scores q · k are not multiplied by the scale 1 / sqrt(head_dim)."""

from paged_kv.reference.lesson05 import *  # every other task stays right
from paged_kv.reference.lesson05 import decode_attention as right_decode_attention

BREAKS = "05.decode_attention"
MESSAGE = "the scores are not scaled"


def decode_attention(q, k, v, scale=None):
    return right_decode_attention(q, k, v, scale=1.0)  # the mistake: q · k is never scaled
