"""A prompt that does not fit whole is skipped, and a later one that fits is admitted before it."""

from paged_kv.reference.lesson10 import *  # every other task stays right

BREAKS = "10.schedule_step"
MESSAGE = "a prompt that does not fit the budget left is passed over and a later, shorter one admitted"


def schedule_step(running, waiting, budget):
    left, scheduled = budget, []
    for request_id, wanted in running:
        n = wanted if left is None else min(wanted, left)
        if n:
            scheduled.append((request_id, n))
            left = None if left is None else left - n
    for request_id, prompt_tokens in waiting:
        if left is not None and prompt_tokens > left:
            continue  # the mistake: no chunk, and the next request jumps the queue
        scheduled.append((request_id, prompt_tokens))
        left = None if left is None else left - prompt_tokens
    return scheduled
