"""The stop string that starts earliest in the text wins, not the first one listed: with stop=['.', '\\n']
the text 'Yes!\\nNo.' ends at the '\\n', where vLLM, trying '.' first, ends it at the '.'."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.stop_strings"
MESSAGE = "vLLM tries the stop strings in the order they are listed"


def cut_at_stop(text, stop):
    found = [(text.find(s), s) for s in stop if s in text]
    if not found:
        return text, None
    at, s = min(found, key=lambda pair: pair[0])  # the mistake: the earliest position, not the list's order
    return text[:at], s
