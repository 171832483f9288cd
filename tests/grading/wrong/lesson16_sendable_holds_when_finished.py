"""The tail held back once the completion has finished too: its last characters never reach the client."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.stop_strings"
MESSAGE = "a finished text is sent whole"


def sendable(text, stop, finished):
    # the mistake: finished is not looked at
    text = text.rstrip("\ufffd")
    hold = max((len(s) for s in stop), default=1) - 1
    return text[: max(len(text) - hold, 0)]
