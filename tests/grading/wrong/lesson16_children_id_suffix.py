"""The index after the request's id: 'cmpl-7_0' where vLLM names the child '0_cmpl-7'."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.child_requests"
MESSAGE = "vLLM puts the index first"


def child_requests(request_id, n, seed):
    if n == 1:
        return [(request_id, seed)]
    return [(f"{request_id}_{i}", None if seed is None else seed + i) for i in range(n)]  # the mistake
