"""Every block of an aborted request's table freed, those another table still holds too: the prefix two
requests share goes back to the free list while the other one still reads it."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.abort"
MESSAGE = "a block another table still holds"


def abort(running, waiting, free_blocks, block_tables, request_ids):
    finished = []
    for request_id in request_ids:
        if request_id in finished:
            continue
        if request_id in running:
            for block_id in reversed(block_tables.pop(request_id)):
                free_blocks.append(block_id)  # the mistake: no count of the block's holders
            running.remove(request_id)
        elif request_id in waiting:
            waiting.remove(request_id)
        else:
            continue
        finished.append(request_id)
    return finished
