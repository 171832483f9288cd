"""Every request listed, those the budget left nothing for with 0 tokens."""

from paged_kv.reference.lesson10 import *  # every other task stays right

BREAKS = "10.schedule_step"
MESSAGE = "entries of 0 tokens are listed"


def schedule_step(running, waiting, budget):
    left, scheduled = budget, []
    for request_id, wanted in [*running, *waiting]:
        n = wanted if left is None else min(wanted, left)
        scheduled.append((request_id, n))  # the mistake: (request_id, 0) kept
        if left is not None:
            left -= n
    return scheduled
