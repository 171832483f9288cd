"""The aborted request leaves running and its table is deleted, but its blocks are never given back:
the pool shrinks by a request's blocks at every hang-up."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.abort"
MESSAGE = "an aborted running request's blocks never reach free_blocks"


def abort(running, waiting, free_blocks, block_tables, request_ids):
    finished = []
    for request_id in request_ids:
        if request_id in finished:
            continue
        if request_id in running:
            del block_tables[request_id]  # the mistake: its blocks are dropped, not freed
            running.remove(request_id)
        elif request_id in waiting:
            waiting.remove(request_id)
        else:
            continue
        finished.append(request_id)
    return finished
