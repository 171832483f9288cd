"""The errors of the paged_kv API.

The rules, shared by every class in the package:

* too few free blocks raises :class:`OutOfBlocksError` (a ``RuntimeError``) that says how many
  blocks were needed and how many are free;
* an unknown sequence raises :class:`UnknownSequenceError` (a ``KeyError``);
* a duplicate sequence id, a negative count, an out-of-range position or a tensor of the wrong
  shape, dtype or device raises ``ValueError`` naming the argument;
* a request's bad value (a sampling parameter, a priority, a salt) raises :class:`ValidationError`
  (a ``ValueError``) whose ``parameter`` names the field, so a server can name it in its answer;
* a call that raises changes nothing.
"""

from __future__ import annotations

from collections.abc import Hashable


class ValidationError(ValueError):
    """A request's value refused (vLLM: ``VLLMValidationError`` in ``vllm/exceptions.py``).

    Attributes:
        parameter: the request's field at fault, by its name in vLLM's ``SamplingParams`` or
            request (``"temperature"``, ``"logprobs"``, ``"cache_salt"``), or ``None``.
        value: the value refused, when one is.
    """

    def __init__(self, message: str, *, parameter: str | None = None, value: object = None) -> None:
        super().__init__(message)
        self.parameter = parameter
        self.value = value


class OutOfBlocksError(RuntimeError):
    """Raised when an allocation needs more free blocks than the pool has.

    Attributes:
        needed: how many free blocks the call needed.
        free: how many blocks were free when it was refused.
    """

    def __init__(self, needed: int, free: int, what: str = "the allocation") -> None:
        self.needed = needed
        self.free = free
        super().__init__(
            f"out of blocks: {what} needs {needed} free block{'s' if needed != 1 else ''} "
            f"but only {free} {'is' if free == 1 else 'are'} free; "
            "free a finished sequence or create the allocator with more blocks"
        )


class UnknownSequenceError(KeyError):
    """Raised when a call names a sequence id the allocator does not hold."""

    def __init__(self, seq_id: Hashable) -> None:
        self.seq_id = seq_id
        super().__init__(seq_id)

    def __str__(self) -> str:
        return (
            f"unknown sequence {self.seq_id!r}: it was never allocated or has been freed; "
            "call allocate_for_sequence first"
        )
