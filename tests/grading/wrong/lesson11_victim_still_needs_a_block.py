"""A victim's own need stays in the count, although it no longer decodes in this step."""

from paged_kv.errors import OutOfBlocksError
from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.choose_victims"
MESSAGE = "a victim does not decode in this step"


def choose_victims(running, num_free_blocks):
    needed = sum(needs for _, _, needs in running)
    free, victims = num_free_blocks, []
    for seq_id, blocks, _needs in reversed(running[1:]):
        if needed <= free:
            break
        victims.append(seq_id)
        free += blocks  # the mistake: needed keeps the victim's block
    if needed > free:
        raise OutOfBlocksError(needed, free)
    return victims
