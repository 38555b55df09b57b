"""An engine that is dropped takes its model, buffers, threads and process groups with it.

Gradient hooks live in the parameters' autograd metadata, which Python's garbage collector cannot
traverse: a hook that leads back to its parameter is a cycle nobody collects. A process that builds
engines one after another (a notebook, an evaluation harness, this test suite's long-lived ranks)
would keep every one, and each gloo group's polling threads with it.
"""

from __future__ import annotations

import gc
import weakref

import pytest

from megazero import mpu, zero
from megazero.model import GPTModel
from megazero.zero.offload import ALIGN
from tests.distributed import run_distributed, thread_names
from tests.zero.common import batches, ds_config, tiny_config


def _gloo_threads() -> int:
    return sum(name.startswith(("gloo", "pt_gloo")) for name in thread_names())


def _build_train_drop(stage: int, offload: bool) -> tuple[weakref.ref, weakref.ref]:
    mpu.initialize_model_parallel(1)
    cfg = ds_config(stage)
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "buffer_count": 3, "buffer_size": ALIGN}
    model = GPTModel(tiny_config())
    engine = zero.initialize(model, cfg, mpu=mpu)
    rows = batches(1, 1, 4)[0, 0][mpu.get_data_parallel_rank() * 2:][:2]
    engine.backward(engine(rows[:, :-1], labels=rows[:, 1:]).mean())
    engine.step()
    refs = weakref.ref(model), weakref.ref(engine)
    mpu.destroy_model_parallel()
    return refs


def _dropped(stage: int, offload: bool):
    _build_train_drop(stage, offload)  # the first engine makes the groups every later one reuses
    gc.collect()
    before = _gloo_threads()
    refs = _build_train_drop(stage, offload)
    gc.collect()
    return [r() is None for r in refs], before, _gloo_threads()


@pytest.mark.skipif(thread_names() is None, reason="counts threads through Linux's /proc")
@pytest.mark.parametrize("stage,offload", [(1, False), (2, True), (3, False)])
def test_a_dropped_engine_leaves_no_model_and_no_group_behind(stage, offload):
    for (model_gone, engine_gone), before, after in run_distributed(2, _dropped, stage, offload):
        assert model_gone and engine_gone
        assert after == before, f"{after - before} gloo threads left by a dropped engine"
