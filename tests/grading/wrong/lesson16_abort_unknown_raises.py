"""An id that is neither running nor waiting raises ValueError (list.remove): an abort that comes after
its request finished crashes the server's loop."""

from collections import Counter

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.abort"
MESSAGE = "an id that is neither running nor waiting (unknown, or finished already) is skipped"


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
            running.remove(request_id)
        else:
            waiting.remove(request_id)  # the mistake: raises for an id that is not waiting either
        finished.append(request_id)
    return finished
