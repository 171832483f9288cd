"""Admitting every waiting request that fits, with no limit on the number of running sequences."""

from paged_kv import blocks_for_tokens
from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.finish_and_admit"
MESSAGE = "at most max_running sequences run"


def finish_and_admit(cache, finished, waiting, max_running):
    for seq_id in finished:
        cache.free_sequence(seq_id)
    admitted = []
    while waiting:
        seq_id, prompt_tokens = waiting[0]
        if blocks_for_tokens(prompt_tokens, cache.block_size) > cache.num_free_blocks:
            break
        waiting.popleft()
        cache.allocate_for_sequence(seq_id, prompt_tokens)
        admitted.append(seq_id)
    return admitted
