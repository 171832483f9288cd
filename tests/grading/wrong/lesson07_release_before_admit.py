"""Finished sequences released before the admissions, so their slots are reused in a step they still run."""

from paged_kv.reference.lesson07 import *  # every other task stays right

BREAKS = "07.continuous_batcher"
MESSAGE = "admit before you release"


class ContinuousBatcher(ContinuousBatcher):
    def step(self, arrivals=()):
        self.waiting.extend(arrivals)
        self.decode()
        finished = self.finish()  # the mistake: released before this step's admissions
        self.admit()
        return finished
