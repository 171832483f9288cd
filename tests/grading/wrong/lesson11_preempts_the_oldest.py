"""Victims taken from the front of running: the oldest sequences lose their place first."""

from paged_kv.errors import OutOfBlocksError
from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.choose_victims"
MESSAGE = "you preempted the oldest sequences first"


def choose_victims(running, num_free_blocks):
    needed = sum(needs for _, _, needs in running)
    free, victims = num_free_blocks, []
    for seq_id, blocks, needs in running[:-1]:  # the mistake: oldest first
        if needed <= free:
            break
        victims.append(seq_id)
        free += blocks
        needed -= needs
    if needed > free:
        raise OutOfBlocksError(needed, free)
    return victims
