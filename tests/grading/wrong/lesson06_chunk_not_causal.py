"""No causal mask: every query of the chunk sees all seq_len positions, later ones included."""

from paged_kv.reference.lesson06 import *  # every other task stays right
from tests.grading.wrong._chunks import not_causal as chunk_attention

BREAKS = "06.chunk_attention"
MESSAGE = "the mask is not causal"
