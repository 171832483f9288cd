"""Admitting out of order: a request that does not fit is skipped, and a younger one that fits jumps ahead."""

from paged_kv.reference.lesson07 import *  # every other task stays right

BREAKS = "07.continuous_batcher"
MESSAGE = "first come first served"


class ContinuousBatcher(ContinuousBatcher):
    def admit(self):
        for request in list(self.waiting):  # the mistake: should stop at the first that does not fit
            if self.reserve(request) <= self.free_tokens:
                self.waiting.remove(request)
                self.free_tokens -= self.reserve(request)
                self.running.append(Running(request, self.reserve(request)))
