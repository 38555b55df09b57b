"""The model-parallel RNG tracker drives the generator of the run's device, decided at fork time.

No GPU is needed: the CUDA generator is faked by a CPU generator behind the tracker's three
device hooks (read, write and seed a device's state), so a "CUDA" and a CPU run can share
one process and one tracker, as they do on a GPU machine.
"""

import torch

from megazero.mpu import parallel_state
from megazero.mpu import random as mrandom
from megazero.mpu.random import RNGStatesTracker

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")
_FAKE_CUDA_SEED_SHIFT = 10**6  # so the fake CUDA stream differs from the CPU stream of the same seed


def _fake_cuda_generator(monkeypatch) -> torch.Generator:
    gen = torch.Generator().manual_seed(0)
    get, put, seeded = mrandom._device_rng_state, mrandom._set_device_rng_state, mrandom._seeded_state
    monkeypatch.setattr(mrandom, "_device_rng_state", lambda d: gen.get_state() if d.type == "cuda" else get(d))
    monkeypatch.setattr(mrandom, "_set_device_rng_state",
                        lambda d, s: gen.set_state(s) if d.type == "cuda" else put(d, s))
    monkeypatch.setattr(mrandom, "_seeded_state", lambda d, seed: (
        torch.Generator().manual_seed(seed + _FAKE_CUDA_SEED_SHIFT).get_state() if d.type == "cuda" else seeded(d, seed)))
    return gen


def test_fork_follows_the_run_device_and_keeps_each_stream(monkeypatch):
    cuda_gen = _fake_cuda_generator(monkeypatch)
    run = {"device": CUDA}
    monkeypatch.setattr(parallel_state, "get_device", lambda: run["device"])
    tracker = RNGStatesTracker()
    tracker.add("s", 7)
    assert tracker.device_type == "cuda"  # seeded for the run's device, not fixed at import
    cuda_ref = torch.Generator().manual_seed(7 + _FAKE_CUDA_SEED_SHIFT)
    cpu_ref = torch.Generator().manual_seed(7)
    cpu_before = torch.get_rng_state()

    with tracker.fork("s"):  # the CUDA run
        torch.testing.assert_close(torch.rand(4, generator=cuda_gen), torch.rand(4, generator=cuda_ref))
    assert torch.equal(torch.get_rng_state(), cpu_before)  # the CPU generator was not touched

    run["device"] = CPU  # a CPU run in the same process
    with tracker.fork("s"):
        torch.testing.assert_close(torch.rand(4), torch.rand(4, generator=cpu_ref))
    assert torch.equal(torch.get_rng_state(), cpu_before)  # restored after the fork

    run["device"] = CUDA  # back on CUDA: that stream continues where it stopped
    with tracker.fork("s"):
        torch.testing.assert_close(torch.rand(4, generator=cuda_gen), torch.rand(4, generator=cuda_ref))
    with tracker.fork("s", device="cpu"):  # the tensors' device overrides the run's
        torch.testing.assert_close(torch.rand(4), torch.rand(4, generator=cpu_ref))
    # Checkpoints carry the streams of the device they were seeded for.
    assert torch.equal(tracker.get_states()["s"], cuda_ref.get_state())


def test_cpu_run_seeds_and_forks_the_cpu_generator(monkeypatch):
    monkeypatch.setattr(parallel_state, "get_device", lambda: CPU)
    tracker = RNGStatesTracker()
    tracker.add("s", 11)
    assert tracker.device_type == "cpu"
    before = torch.get_rng_state()
    ref = torch.Generator().manual_seed(11)
    for device in (None, CPU, torch.device("meta")):  # any non-CUDA device draws from the CPU generator
        with tracker.fork("s", device=device):
            torch.testing.assert_close(torch.rand(3), torch.rand(3, generator=ref))
    assert torch.equal(torch.get_rng_state(), before)
    restored = RNGStatesTracker()
    restored.set_states(tracker.get_states())
    with restored.fork("s"):  # a resumed run continues the saved stream
        torch.testing.assert_close(torch.rand(3), torch.rand(3, generator=ref))
