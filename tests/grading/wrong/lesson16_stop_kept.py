"""The stop string kept at the end of the text: vLLM leaves it out by default
(include_stop_str_in_output=False)."""

from paged_kv.reference.lesson16 import *  # every other task stays right

BREAKS = "16.stop_strings"
MESSAGE = "the stop string is left out of the text"


def cut_at_stop(text, stop):
    for s in stop:
        at = text.find(s)
        if at != -1:
            return text[: at + len(s)], s  # the mistake: cut after the stop string, not before it
    return text, None
