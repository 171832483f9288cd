"""The ranking upside down: the most urgent request (the smallest priority) preempted first."""

from paged_kv.errors import OutOfBlocksError
from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.priority_victims"
MESSAGE = "you took the most urgent first"


def priority_victims(running, num_free_blocks):
    order = sorted(running, key=lambda entry: (entry[3], entry[4]))  # the mistake: smallest first
    needed, free, victims = sum(entry[2] for entry in running), num_free_blocks, []
    while needed > free:
        if len(victims) == len(running) - 1:
            raise OutOfBlocksError(needed, free)
        seq_id, blocks, needs, _, _ = order[len(victims)]
        victims.append(seq_id)
        free += blocks
        needed -= needs
    return victims
