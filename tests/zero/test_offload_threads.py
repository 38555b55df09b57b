"""The optimizer offload's I/O threads work on the rank's own device and copy on streams of their own.

CUDA's current device is per thread and 0 in a new thread: without binding, rank k's reader and
writer would work on GPU 0. Checked here with ``torch.cuda.set_device`` recorded per thread; the
streams and events themselves run in ``scripts/gpu_check.sh`` on a GPU.
"""

import threading

import torch

from megazero.zero import offload as offload_mod
from megazero.zero.offload import bind_device, io_thread


def test_an_io_thread_sets_its_device_before_its_first_task(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: calls.append((threading.current_thread().name, d)))
    pool = io_thread("offload-read", torch.device("cuda", 3))
    try:
        seen = pool.submit(lambda: (threading.current_thread().name, list(calls))).result()
    finally:
        pool.shutdown(wait=True)
    name, before = seen
    assert before == [(name, torch.device("cuda", 3))]  # bound in the worker, before the task ran
    assert name.startswith("offload-read")


def test_binding_is_a_no_op_off_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "set_device", lambda d: (_ for _ in ()).throw(AssertionError("called")))
    bind_device(torch.device("cpu"))
    bind_device(torch.device("meta"))


def test_the_optimizer_offload_builds_its_threads_bound_to_its_device(monkeypatch):
    made = []
    real = offload_mod.io_thread
    monkeypatch.setattr(offload_mod, "io_thread", lambda name, device: made.append((name, device)) or real(name, device))
    from megazero import zero
    from tests.zero.common import ds_config, tiny_config
    from megazero.model import GPTModel

    cfg = ds_config(2, zero_optimization={"stage": 2, "offload_optimizer": {"device": "cpu"}})
    engine = zero.initialize(GPTModel(tiny_config()), cfg)
    assert made == [("offload-read", engine.device), ("offload-write", engine.device)]
    assert engine.offload._read_stream is None and engine.offload._write_stream is None  # CPU: no streams
