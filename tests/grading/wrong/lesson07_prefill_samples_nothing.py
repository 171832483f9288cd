"""A request admitted with no output token, as if its prefill sampled none: each runs one step too many."""

from paged_kv.reference.lesson07 import *  # every other task stays right

BREAKS = "07.continuous_batcher"
MESSAGE = "samples its first output token"


class ContinuousBatcher(ContinuousBatcher):
    def admit(self):
        while self.waiting and self.reserve(self.waiting[0]) <= self.free_tokens:
            request = self.waiting.popleft()
            self.free_tokens -= self.reserve(request)
            self.running.append(Running(request, self.reserve(request), generated=0))  # the mistake
