"""default_device(): CUDA when present, else the CPU, or what PAGED_KV_DEVICE says."""

from __future__ import annotations

import pytest
import torch

from paged_kv import default_device
from paged_kv.device import DEVICE_VARIABLE

pytestmark = pytest.mark.setup


def test_the_default_is_cuda_when_present_else_cpu(monkeypatch):
    monkeypatch.delenv(DEVICE_VARIABLE, raising=False)
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert default_device() == torch.device(expected)


def test_the_variable_chooses_the_device(monkeypatch):
    monkeypatch.setenv(DEVICE_VARIABLE, " cpu ")
    assert default_device() == torch.device("cpu")


@pytest.mark.parametrize("choice", ["gpu-please", "cuda:99"])
def test_an_unusable_choice_is_a_clear_error(monkeypatch, choice):
    monkeypatch.setenv(DEVICE_VARIABLE, choice)
    with pytest.raises(ValueError, match=f"PAGED_KV_DEVICE='{choice}' is not a usable device"):
        default_device()


def test_resolve_device_makes_the_cuda_index_explicit(device):
    from paged_kv.device import resolve_device

    tensor = torch.empty(1, device=device)
    assert resolve_device(device.type) == tensor.device  # "cuda" is the device a tensor reports
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device(torch.device("cpu")) == torch.device("cpu")
