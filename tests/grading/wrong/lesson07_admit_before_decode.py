"""Admitting before decoding, so a request decodes a token in the very step it prefills."""

from paged_kv.reference.lesson07 import *  # every other task stays right

BREAKS = "07.continuous_batcher"
MESSAGE = "decode the running sequences before you admit"


class ContinuousBatcher(ContinuousBatcher):
    def step(self, arrivals=()):
        self.waiting.extend(arrivals)
        self.admit()
        self.decode()  # the mistake: the requests just admitted decode in their prefill step
        return self.finish()
