"""budget=None not handled: min(wanted, None) raises a TypeError."""

from paged_kv.reference.lesson10 import *  # every other task stays right

BREAKS = "10.schedule_step"
MESSAGE = "budget=None means no budget"


def schedule_step(running, waiting, budget):
    left, scheduled = budget, []
    for request_id, wanted in [*running, *waiting]:
        if left == 0:
            break
        n = min(wanted, left)  # the mistake: left may be None
        scheduled.append((request_id, n))
        left -= n
    return scheduled
