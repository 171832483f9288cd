"""Memory released only when the whole batch has finished (static batching), not when each sequence does."""

from paged_kv.reference.lesson07 import *  # every other task stays right

BREAKS = "07.continuous_batcher"
MESSAGE = "static batching"


class ContinuousBatcher(ContinuousBatcher):
    def __init__(self, budget_tokens, reserve):
        super().__init__(budget_tokens, reserve)
        self.finished_in_batch = []  # finished, but their slots still reserved

    def finish(self):
        done = [seq for seq in self.running if seq.generated == seq.request.output_tokens]
        self.running = [seq for seq in self.running if seq not in done]
        self.finished_in_batch += done
        if not self.running:  # the mistake: the slots come back only once the whole batch is done
            self.free_tokens += sum(seq.reserved for seq in self.finished_in_batch)
            self.finished_in_batch = []
        return [seq.request.request_id for seq in done]
