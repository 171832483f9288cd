"""Slots computed from the int32 block tables and returned as an int32 tensor, not a LongTensor."""

from paged_kv.reference.lesson09 import *  # every other task stays right
from paged_kv.reference.lesson09 import decode_slots as right_decode_slots

BREAKS = "09.decode_slots"
MESSAGE = "make a LongTensor"


def decode_slots(allocator, seq_ids):
    return right_decode_slots(allocator, seq_ids).int()  # the mistake: int32
