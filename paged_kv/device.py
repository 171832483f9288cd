"""Which device the course runs on: every lesson's first cell asks :func:`default_device`."""

from __future__ import annotations

import os

import torch

DEVICE_VARIABLE = "PAGED_KV_DEVICE"


def default_device() -> torch.device:
    """The device lessons and examples put their tensors on.

    CUDA when a GPU is visible, else the CPU. Set the environment variable ``PAGED_KV_DEVICE``
    (for example ``cpu``, ``cuda:1`` or ``mps``) to choose another one; an invalid or unavailable
    choice raises ``ValueError`` rather than silently falling back.
    """
    choice = os.environ.get(DEVICE_VARIABLE, "").strip()
    if not choice:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(choice)
        torch.empty(1, device=device)
    except (RuntimeError, AssertionError) as error:
        raise ValueError(f"{DEVICE_VARIABLE}={choice!r} is not a usable device: {error}") from None
    return device


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` with its index made explicit: ``"cuda"`` is the current CUDA device, ``cuda:0`` say,
    which is how a tensor or a model on it reports its device; other devices are returned as given."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return device
