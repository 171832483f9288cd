"""The sum compared with > instead of >=: the step after the chunk that completes the prompt."""

from paged_kv.reference.lesson10 import *  # every other task stays right

BREAKS = "10.first_token_steps"
MESSAGE = "one step late"


def first_token_steps(scheduled_tokens, prompt_lens):
    computed = dict.fromkeys(prompt_lens, 0)
    first = {}
    for step, scheduled in enumerate(scheduled_tokens):
        for request_id, n in scheduled:
            computed[request_id] += n
            if request_id not in first and computed[request_id] > prompt_lens[request_id]:  # the mistake
                first[request_id] = step
    return first
