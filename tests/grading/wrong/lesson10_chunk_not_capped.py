"""Each request takes all it needs while any budget is left: the last one runs the step over budget."""

from paged_kv.reference.lesson10 import *  # every other task stays right

BREAKS = "10.schedule_step"
MESSAGE = "a chunk is not capped by the budget left"


def schedule_step(running, waiting, budget):
    left, scheduled = budget, []
    for request_id, wanted in [*running, *waiting]:
        if left is not None and left <= 0:
            break
        scheduled.append((request_id, wanted))  # the mistake: not min(wanted, left)
        if left is not None:
            left -= wanted
    return scheduled
