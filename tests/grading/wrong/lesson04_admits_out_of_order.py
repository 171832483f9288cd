"""Skipping a waiting request that does not fit and admitting a younger one that does."""

from paged_kv import blocks_for_tokens
from paged_kv.reference.lesson04 import *  # every other task stays right

BREAKS = "04.finish_and_admit"
MESSAGE = "skipped ahead of"


def finish_and_admit(cache, finished, waiting, max_running):
    for seq_id in finished:
        cache.free_sequence(seq_id)
    admitted = []
    for request in list(waiting):
        seq_id, prompt_tokens = request
        fits = blocks_for_tokens(prompt_tokens, cache.block_size) <= cache.num_free_blocks
        if fits and len(cache.seq_ids) < max_running:
            waiting.remove(request)
            cache.allocate_for_sequence(seq_id, prompt_tokens)
            admitted.append(seq_id)
    return admitted
