"""Counting a prompt's blocks as prompt_tokens // block_size, rounding down instead of up."""

from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.finish_and_admit"
MESSAGE = "ceil(13 / 4) = 4 blocks"


def finish_and_admit(cache, finished, waiting, max_running):
    for seq_id in finished:
        cache.free_sequence(seq_id)
    admitted = []
    while waiting and len(cache.seq_ids) < max_running:
        seq_id, prompt_tokens = waiting[0]
        if prompt_tokens // cache.block_size > cache.num_free_blocks:
            break
        waiting.popleft()
        cache.allocate_for_sequence(seq_id, prompt_tokens)
        admitted.append(seq_id)
    return admitted
