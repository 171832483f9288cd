"""A victim's blocks are never counted as free: the loop preempts more sequences than needed."""

from paged_kv.errors import OutOfBlocksError
from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.choose_victims"
MESSAGE = "a victim's blocks become free"


def choose_victims(running, num_free_blocks):
    needed = sum(needs for _, _, needs in running)
    victims = []
    for seq_id, _blocks, needs in reversed(running[1:]):
        if needed <= num_free_blocks:  # the mistake: the victims' blocks are not added
            break
        victims.append(seq_id)
        needed -= needs
    if needed > num_free_blocks:
        raise OutOfBlocksError(needed, num_free_blocks)
    return victims
