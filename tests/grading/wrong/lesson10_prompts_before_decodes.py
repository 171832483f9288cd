"""The queue served before the running requests: prompts first, decodes with what is left."""

from paged_kv.reference.lesson10 import *  # every other task stays right

BREAKS = "10.schedule_step"
MESSAGE = "the waiting prompts are scheduled before the running requests"


def schedule_step(running, waiting, budget):
    left, scheduled = budget, []
    for request_id, wanted in [*waiting, *running]:  # the mistake: waiting first
        if left == 0:
            break
        n = wanted if left is None else min(wanted, left)
        scheduled.append((request_id, n))
        if left is not None:
            left -= n
    return scheduled
