"""The right victims, listed oldest first instead of in the order they are preempted."""

from paged_kv.reference.lesson11 import *  # every other task stays right
from paged_kv.reference.lesson11 import choose_victims as _choose_victims

BREAKS = "11.choose_victims"
MESSAGE = "the right victims in the wrong order"


def choose_victims(running, num_free_blocks):
    return _choose_victims(running, num_free_blocks)[::-1]  # the mistake: reversed
