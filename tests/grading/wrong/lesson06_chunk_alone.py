"""The chunk attends over its own new tokens alone, as a fresh prompt would: the cached ones go unseen."""

from paged_kv.reference.lesson06 import *  # every other task stays right
from tests.grading.wrong._chunks import chunk_alone as chunk_attention

BREAKS = "06.chunk_attention"
MESSAGE = "the chunk attends over its own tokens only"
