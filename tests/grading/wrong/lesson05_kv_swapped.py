"""K and V swapped in decode attention: the scores come from q · v, and the weights multiply k."""

from paged_kv.reference.lesson05 import *  # every other task stays right
from paged_kv.reference.lesson05 import decode_attention as right_decode_attention

BREAKS = "05.decode_attention"
MESSAGE = "K and V are swapped"


def decode_attention(q, k, v, scale=None):
    return right_decode_attention(q, v, k, scale)  # the mistake: v where k belongs, k where v belongs
