"""Victims at the front of the queue, but the newest ahead of the older ones."""

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.choose_victims"
MESSAGE = "at the front but the newest first"


def requeue(waiting, victims):
    for seq_id in reversed(victims):
        waiting.appendleft(seq_id)  # the mistake: the last one in ends up first
