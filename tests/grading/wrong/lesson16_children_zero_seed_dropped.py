"""`if seed` for `seed is not None`: a request seeded with 0 gets children without seeds."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.child_requests"
MESSAGE = "a seed of 0 is a seed"


def child_requests(request_id, n, seed):
    if n == 1:
        return [(request_id, seed)]
    return [(f"{i}_{request_id}", seed + i if seed else None) for i in range(n)]  # the mistake: 0 is falsy
