"""The host -> device move of a loader batch: a no-op on CPU, an asynchronous copy from pinned
memory on CUDA (checked with a spy on ``Tensor.to``: no GPU needed)."""

import pytest
import torch

from megazero.data import build_pretraining_data_loader, pin_memory_for, to_device


def _spy_to(monkeypatch):
    calls = []

    def fake_to(self, *args, **kwargs):
        calls.append((args, kwargs))
        return self  # nothing is copied: there is no GPU here

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    return calls


def test_cpu_is_the_same_tensor():
    t = torch.arange(6).view(2, 3)
    for device in ("cpu", torch.device("cpu")):
        assert to_device(t, device) is t  # no copy


@pytest.mark.parametrize("device", ["cuda", "cuda:1", torch.device("cuda", 0)])
def test_cuda_copy_is_non_blocking(monkeypatch, device):
    calls = _spy_to(monkeypatch)
    to_device(torch.arange(4), device)
    assert calls == [((torch.device(device),), {"non_blocking": True})]


def test_cpu_copy_is_not_asked_to_be_non_blocking(monkeypatch):
    calls = _spy_to(monkeypatch)
    to_device(torch.arange(4), "cpu")
    assert calls == [((torch.device("cpu"),), {"non_blocking": False})]


def test_loader_pins_only_for_cuda():
    assert pin_memory_for("cuda") and pin_memory_for(torch.device("cuda", 3))
    assert not pin_memory_for("cpu") and not pin_memory_for("meta")
    data = [{"text": [1, 2, 3]}] * 8
    for device, pinned in (("cpu", False), ("cuda", True)):
        loader = build_pretraining_data_loader(data, 0, 2, 0, 1, device=device)
        assert loader.pin_memory is pinned
    assert build_pretraining_data_loader(data, 0, 2, 0, 1).pin_memory is torch.cuda.is_available()
