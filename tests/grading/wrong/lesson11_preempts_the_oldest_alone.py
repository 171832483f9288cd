"""When nothing else helps, the oldest sequence is preempted too, and nothing is left running."""

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.choose_victims"
MESSAGE = "never preempt the oldest sequence"


def choose_victims(running, num_free_blocks):
    needed = sum(needs for _, _, needs in running)
    free, victims = num_free_blocks, []
    for seq_id, blocks, needs in reversed(running):  # the mistake: running[1:] keeps the oldest
        if needed <= free:
            break
        victims.append(seq_id)
        free += blocks
        needed -= needs
    return victims
