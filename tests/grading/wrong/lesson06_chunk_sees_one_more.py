"""The causal mask one position late: query i also sees the position after its own."""

from paged_kv.reference.lesson06 import *  # every other task stays right
from tests.grading.wrong._chunks import sees_one_more as chunk_attention

BREAKS = "06.chunk_attention"
MESSAGE = "query i sees one position past its own"
