"""Every child given the request's seed: the n completions draw the same numbers and come out identical."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.child_requests"
MESSAGE = "each child gets its own seed, seed + i"


def child_requests(request_id, n, seed):
    if n == 1:
        return [(request_id, seed)]
    return [(f"{i}_{request_id}", seed) for i in range(n)]  # the mistake: seed, not seed + i
