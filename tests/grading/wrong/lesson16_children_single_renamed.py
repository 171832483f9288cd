"""A request with one completion renamed like a child, '0_cmpl-7': vLLM makes no ParentRequest for it and
the core serves it under its own id."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.child_requests"
MESSAGE = "a request with n == 1 keeps its own id and seed"


def child_requests(request_id, n, seed):
    # the mistake: no case for n == 1
    return [(f"{i}_{request_id}", None if seed is None else seed + i) for i in range(n)]
