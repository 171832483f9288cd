"""text[:-hold] to hold back the tail: with no stop strings hold is 0, and text[:-0] is '', so a stream
without stop strings sends nothing until it finishes."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.stop_strings"
MESSAGE = "text[:-hold] is '' when hold is 0"


def sendable(text, stop, finished):
    if finished:
        return text
    text = text.rstrip("\ufffd")
    hold = max((len(s) for s in stop), default=1) - 1
    return text[:-hold]  # the mistake: -0 is 0
