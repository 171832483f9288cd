"""Exercise 06 graded on the package: ``next_power_of_two`` and ``reserved_tokens`` are the size
classes and the contiguous reservation of :mod:`paged_kv.simulation.workload`
(``ContiguousPolicy.reservation``
delegates to ``reserved_tokens``), and ``ContinuousBatcher`` is the package's
:class:`~paged_kv.simulation.workload.ContinuousBatcher`, the engine step ``simulate`` runs, over a
:class:`~paged_kv.simulation.workload.ContiguousPool` of ``budget_tokens`` slots shared out by ``reserve``:
the
subclass only turns the exercise's ``ContinuousBatcher(budget_tokens, reserve)`` into that pool.
"""

from collections.abc import Callable as _Callable

from paged_kv.simulation.workload import ContiguousPool as _ContiguousPool
from paged_kv.simulation.workload import ContinuousBatcher as _ContinuousBatcher
from paged_kv.simulation.workload import Request as _Request
from paged_kv.simulation.workload import next_power_of_two, reserved_tokens

__all__ = ["ContinuousBatcher", "next_power_of_two", "reserved_tokens"]


class ContinuousBatcher(_ContinuousBatcher):
    """The package's continuous batching over ``budget_tokens`` slots, ``reserve(request)`` per request."""

    def __init__(self, budget_tokens: int, reserve: _Callable[[_Request], int]) -> None:
        super().__init__(_ContiguousPool(budget_tokens, reserve))
