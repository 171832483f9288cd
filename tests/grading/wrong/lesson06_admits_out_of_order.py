"""Admitting out of order: a request that does not fit is skipped, and a younger one that fits jumps ahead."""

from paged_kv.grading.reference.lesson06 import *  # every other task stays right
from paged_kv.simulation.workload import RunningSequence

BREAKS = "06.continuous_batcher"
MESSAGE = "first come first served"


class ContinuousBatcher(ContinuousBatcher):
    def admit(self):
        for request in list(self.waiting):  # the mistake: should stop at the first that does not fit
            if self.pool.can_admit(request):
                self.waiting.remove(request)
                self.pool.admit(request)
                self.running.append(RunningSequence(request))
