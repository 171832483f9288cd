"""running and waiting rebuilt as new lists inside the function: the scheduler's own lists still hold the
aborted requests, whose blocks are already free."""

from collections import Counter

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.abort"
MESSAGE = "change running, waiting, free_blocks and block_tables themselves, in place"


def abort(running, waiting, free_blocks, block_tables, request_ids):
    holders = Counter(block_id for table in block_tables.values() for block_id in table)
    finished = []
    for request_id in request_ids:
        if request_id in finished:
            continue
        if request_id in running:
            for block_id in reversed(block_tables.pop(request_id)):
                holders[block_id] -= 1
                if holders[block_id] == 0:
                    free_blocks.append(block_id)
        elif request_id not in waiting:
            continue
        finished.append(request_id)
    running = [r for r in running if r not in finished]  # the mistake: new lists, not the scheduler's
    waiting = [r for r in waiting if r not in finished]
    return finished
