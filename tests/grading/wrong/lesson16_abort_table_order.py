"""A request's blocks given back first to last: a cached prefix then loses its first block before its
last, and the blocks after it can no longer be found."""

from collections import Counter

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.abort"
MESSAGE = "a request gives its blocks back the last first"


def abort(running, waiting, free_blocks, block_tables, request_ids):
    holders = Counter(block_id for table in block_tables.values() for block_id in table)
    finished = []
    for request_id in request_ids:
        if request_id in finished:
            continue
        if request_id in running:
            for block_id in block_tables.pop(request_id):  # the mistake: not reversed
                holders[block_id] -= 1
                if holders[block_id] == 0:
                    free_blocks.append(block_id)
            running.remove(request_id)
        elif request_id in waiting:
            waiting.remove(request_id)
        else:
            continue
        finished.append(request_id)
    return finished
