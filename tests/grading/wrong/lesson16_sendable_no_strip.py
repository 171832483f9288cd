"""A trailing '\\ufffd' sent: the client reads a replacement character where the next token completes
'é' or '€'."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.stop_strings"
MESSAGE = "a trailing '\\ufffd' is a character whose bytes have not all arrived"


def sendable(text, stop, finished):
    if finished:
        return text
    # the mistake: no text.rstrip("\ufffd")
    hold = max((len(s) for s in stop), default=1) - 1
    return text[: max(len(text) - hold, 0)]
