"""The causal mask lined up at position 0 (SDPA's is_causal, fewer queries than keys): query i sees 0 .. i."""

from paged_kv.reference.lesson06 import *  # every other task stays right
from tests.grading.wrong._chunks import from_position_zero as chunk_attention

BREAKS = "06.chunk_attention"
MESSAGE = "as if it started at position 0"
