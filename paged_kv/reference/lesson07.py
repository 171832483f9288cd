"""Exercise 07 graded on the package: ``next_power_of_two`` and ``reserved_tokens`` are the size
classes and the contiguous reservation of :mod:`paged_kv.simulation.workload`
(``ContiguousPolicy.reservation`` delegates to ``reserved_tokens``). ``ContinuousBatcher`` is the
exercise's teaching scheduler, contiguous reservations only: the package's one scheduler,
:class:`~paged_kv.serving.scheduler.Scheduler`, which ``simulate`` runs, decides the same steps
for a contiguous memory (the checks compare the two).
"""

from collections import deque as _deque
from dataclasses import dataclass as _dataclass

from paged_kv.simulation.workload import Request as _Request
from paged_kv.simulation.workload import next_power_of_two, reserved_tokens

__all__ = ["ContinuousBatcher", "Running", "next_power_of_two", "reserved_tokens"]


@_dataclass
class Running:
    """A sequence being served: its request, the slots reserved for it, the output tokens it holds."""

    request: _Request
    reserved: int
    generated: int = 1  # its prefill samples the first output token


class ContinuousBatcher:
    """Continuous batching with one contiguous reservation per sequence, first come first served."""

    def __init__(self, budget_tokens: int, reserve) -> None:
        self.free_tokens = budget_tokens
        self.reserve = reserve  # request -> slots reserved for it at admission
        self.waiting: _deque[_Request] = _deque()  # the oldest at the front
        self.running: list[Running] = []  # in admission order

    def step(self, arrivals=()) -> list:
        """One step of the engine; returns the ids of the requests that finished in it."""
        self.waiting.extend(arrivals)
        self.decode()
        self.admit()
        return self.finish()

    def decode(self) -> None:
        """Every running sequence samples one more token."""
        for seq in self.running:
            seq.generated += 1

    def admit(self) -> None:
        """Admit from the front of the queue while the reservation fits; each prefills its first token."""
        while self.waiting and self.reserve(self.waiting[0]) <= self.free_tokens:
            request = self.waiting.popleft()
            reserved = self.reserve(request)
            self.free_tokens -= reserved
            self.running.append(Running(request, reserved))

    def finish(self) -> list:
        """Release the sequences that hold all their output at once; return their ids."""
        finished = [seq for seq in self.running if seq.generated == seq.request.output_tokens]
        for seq in finished:
            self.free_tokens += seq.reserved
        self.running = [seq for seq in self.running if seq.generated < seq.request.output_tokens]
        return [seq.request.request_id for seq in finished]
