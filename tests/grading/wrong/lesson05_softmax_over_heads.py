"""The softmax taken over the wrong dimension: over the heads instead of over the tokens."""

import torch

from paged_kv.reference.lesson05 import *  # every other task stays right

BREAKS = "05.decode_attention"
MESSAGE = "the softmax runs over the heads"


def decode_attention(q, k, v, scale=None):
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.einsum("hd,thd->ht", q, k) * scale
    weights = torch.softmax(scores, dim=0)  # the mistake: dim=0 is the heads, the tokens are dim=-1
    return torch.einsum("ht,thd->hd", weights, v)
