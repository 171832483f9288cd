"""The first-come-first-served victims under priority: the newest first, whatever its priority."""

from paged_kv.reference.lesson11 import *  # every other task stays right
from paged_kv.reference.lesson11 import choose_victims as _choose_victims

BREAKS = "11.priority_victims"
MESSAGE = "you took the newest first"


def priority_victims(running, num_free_blocks):
    return _choose_victims([entry[:3] for entry in running], num_free_blocks)  # the mistake: no ranks
