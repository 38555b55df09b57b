"""Offloaded host state lives in one exact-size allocation per offload object, carved into views.

Pinning is mocked (CPU builds cannot pin): the helper that pins is replaced by one that records its
calls and returns pageable memory, which is all the engine can tell apart.
"""

from __future__ import annotations

import torch

from megazero.zero import pinned
from megazero.zero.pinned import ALIGN_BYTES, HostArena
from tests.distributed import run_distributed
from tests.zero.test_offload import _engine, _train

REQUESTS = {
    "master": (1001, torch.float32, "state"),
    "weights": (333, torch.bfloat16, "params"),
    "ring": (77, torch.uint8, "ring"),
    "moment": (4096, torch.float32, "state"),
    "half": (5, torch.float16, "params"),
}


def _record_pins(monkeypatch=None):
    """Replace the pinning helper with one that records the sizes asked for; returns that list."""
    calls: list[int] = []

    def fake(nbytes: int) -> torch.Tensor:
        calls.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)

    if monkeypatch is not None:
        monkeypatch.setattr(pinned, "pinned_bytes", fake)
    else:  # in a spawned worker, which ends with the test
        pinned.pinned_bytes = fake
    return calls


def test_views_are_disjoint_aligned_and_fill_the_arena_exactly(monkeypatch):
    calls = _record_pins(monkeypatch)
    arena = HostArena(REQUESTS, True, torch.device("cpu"))
    assert arena.pinned and calls == [arena.nbytes]  # one allocation for every view
    base = arena.buffer.data_ptr()
    spans = []
    for key, (numel, dtype, _) in REQUESTS.items():
        v = arena.views[key]
        assert v.dtype == dtype and v.shape == (numel,) and v.is_contiguous()
        assert v.untyped_storage().data_ptr() == base  # a view of the arena, not a copy
        lo = v.data_ptr() - base
        assert lo % ALIGN_BYTES == 0
        spans.append((lo, lo + numel * v.element_size()))
    spans.sort()
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))  # no overlap
    assert spans[-1][1] <= arena.nbytes < spans[-1][1] + ALIGN_BYTES
    padded = sum(-(-n * torch.empty((), dtype=d).element_size() // ALIGN_BYTES) * ALIGN_BYTES
                 for n, d, _ in REQUESTS.values())
    assert arena.nbytes == padded
    assert arena.bytes_of("state") + arena.bytes_of("params") + arena.bytes_of("ring") == arena.nbytes
    assert arena.bytes_of("state") == 4032 + 4 * 4096 and arena.bytes_of("nothing") == 0
    for i, v in enumerate(arena.views.values()):  # each view keeps what was written through it
        v.fill_(i + 1)
    assert all(bool(v.eq(i + 1).all()) for i, v in enumerate(arena.views.values()))


def test_a_failed_pin_falls_back_to_pageable_memory(monkeypatch):
    def refuse(nbytes: int) -> torch.Tensor:
        raise RuntimeError("cannot pin")

    monkeypatch.setattr(pinned, "pinned_bytes", refuse)
    arena = HostArena(REQUESTS, True, torch.device("cpu"))
    assert not arena.pinned and arena.buffer.device.type == "cpu" and arena.buffer.numel() == arena.nbytes


def test_unpinned_meta_and_empty_arenas_pin_nothing(monkeypatch):
    calls = _record_pins(monkeypatch)
    assert not HostArena(REQUESTS, False, torch.device("cpu")).pinned
    meta = HostArena(REQUESTS, True, torch.device("meta"))  # a rehearsal counts the bytes, holds none
    assert meta.buffer.is_meta and all(v.is_meta for v in meta.views.values())
    assert meta.nbytes == HostArena(REQUESTS, False, torch.device("cpu")).nbytes
    assert HostArena({}, True, torch.device("cpu")).nbytes == 0
    assert calls == []


class _FakeCudart:
    """Records the driver's registrations; ``fail`` makes them return that error code."""

    def __init__(self, fail: int = 0) -> None:
        self.fail, self.registered, self.unregistered = fail, [], []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:
        self.registered.append((ptr, size))
        return self.fail

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


def test_pinned_bytes_registers_exactly_the_size_and_unregisters_with_the_last_view(monkeypatch):
    cudart = _FakeCudart()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    buf = pinned.pinned_bytes(3 * 1000 + 7)
    assert buf.dtype == torch.uint8 and buf.numel() == 3007 and buf.data_ptr() % 4096 == 0
    assert cudart.registered == [(buf.data_ptr(), 3007)]  # not rounded up to a power of two
    ptr, view = buf.data_ptr(), buf[64:64 + 400].view(torch.float32)
    view.fill_(2.5)
    del buf
    assert cudart.unregistered == [] and bool(view.eq(2.5).all())  # the view keeps the pages
    del view
    assert cudart.unregistered == [ptr]


def test_a_refused_registration_falls_back_to_pageable_memory(monkeypatch):
    cudart = _FakeCudart(fail=2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    arena = HostArena(REQUESTS, True, torch.device("cpu"))
    assert not arena.pinned and len(cudart.registered) == 1 and cudart.unregistered == []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only build
    assert not HostArena(REQUESTS, True, torch.device("cpu")).pinned and len(cudart.registered) == 1


def _engine_pins(stage: int, bf16: bool):
    calls = _record_pins()
    off = {"device": "cpu", "pin_memory": True, "buffer_count": 3, "buffer_size": 5000}
    param = {"device": "cpu", "pin_memory": True} if stage == 3 else None
    engine = _engine(off, stage=stage, bf16=bf16, param=param)
    held = [engine.offload.arena.nbytes]
    pins = [engine.offload.pinned]
    if engine.param_offload is not None:
        held.append(engine.param_offload.arena.nbytes)
        pins.append(engine.param_offload.pinned)
    before = engine.model_state_bytes()
    built = list(calls)
    losses = _train(engine, 2)
    after = engine.model_state_bytes()
    host = {k: v for k, v in after.items() if k.startswith("host_")}
    return built, calls, held, pins, before, host, losses


def _engine_unpinned(stage: int, bf16: bool):
    param = {"device": "cpu"} if stage == 3 else None
    return _train(_engine({"device": "cpu", "buffer_count": 3, "buffer_size": 5000}, stage=stage, bf16=bf16,
                          param=param), 2)


def _check(stage: int, bf16: bool, arenas: int):
    results = run_distributed(2, _engine_pins, stage, bf16)
    for built, calls, held, pins, before, host, _ in results:
        assert len(held) == arenas and all(pins)
        assert built == held and calls == held  # one pinned allocation per arena, none at the steps
        assert sum(host.values()) == sum(held)  # reported host bytes are the arenas' bytes
        assert all(before[k] == v for k, v in host.items())  # held from construction on
        assert host["host_optimizer"] > 0 and host["host_ring"] > 0
    # views of one arena train bit for bit as pageable memory does
    assert [r[-1] for r in results] == run_distributed(2, _engine_unpinned, stage, bf16)


def test_zero1_optimizer_offload_pins_one_arena():
    _check(1, False, 1)


def test_zero3_optimizer_and_param_offload_pin_one_arena_each():
    _check(3, True, 2)
