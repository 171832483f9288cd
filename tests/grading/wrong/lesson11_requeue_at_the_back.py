"""Preempted requests requeued at the back, behind requests that arrived after them."""

from paged_kv.reference.lesson11 import *  # every other task stays right

BREAKS = "11.choose_victims"
MESSAGE = "the victims went to the back of the queue"


def requeue(waiting, victims):
    for seq_id in reversed(victims):
        waiting.append(seq_id)  # the mistake: should go to the front
