"""The whole length of the longest stop string held back, not one less: a stream with stop=['\\n'] then
holds back its last character for nothing."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.stop_strings"
MESSAGE = "hold back the longest stop string's length less one"


def sendable(text, stop, finished):
    if finished:
        return text
    text = text.rstrip("\ufffd")
    hold = max((len(s) for s in stop), default=0)  # the mistake: no - 1
    return text[: max(len(text) - hold, 0)]
