"""The victims are popped off the caller's list: the engine's running list loses them behind its back."""

from paged_kv.errors import OutOfBlocksError
from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.choose_victims"
MESSAGE = "leave running as it is"


def choose_victims(running, num_free_blocks):
    needed = sum(needs for _, _, needs in running)
    free, victims = num_free_blocks, []
    while needed > free:
        if len(running) == 1:
            raise OutOfBlocksError(needed, free)
        seq_id, blocks, needs = running.pop()  # the mistake: changes the caller's list
        victims.append(seq_id)
        free += blocks
        needed -= needs
    return victims
