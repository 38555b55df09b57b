"""The offloaded optimizer step's parts: the ring's order and bound, the overlap, host bytes, files.

The end-to-end exactness (``pretrain_gpt.py`` with and without offload, bit for bit, checkpoints
crossing over) is in ``tests/training/test_offload.py``; these tests look inside one engine.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from megazero import mpu, zero
from megazero.model import GPTModel
from megazero.zero.config import ZeroConfigError, load_config
from megazero.zero.offload import ALIGN
from megazero.zero.pinned import ALIGN_BYTES
from tests.distributed import run_distributed
from tests.zero.common import ds_config, tiny_config


def _engine(offload: dict | None, stage: int = 2, bf16: bool = False, param: dict | None = None, **model):
    mpu.initialize_model_parallel(1)
    cfg = ds_config(stage, micro=8 // mpu.get_data_parallel_world_size())
    if offload is not None:
        cfg["zero_optimization"]["offload_optimizer"] = offload
    if param is not None:  # ZeRO-3's parameter offload, every parameter partitioned (none persistent)
        cfg["zero_optimization"].update(offload_param=param, stage3_param_persistence_threshold=0)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    torch.manual_seed(5)
    return zero.initialize(GPTModel(tiny_config(**model)), cfg, mpu=mpu)


def _train(engine, steps: int = 2) -> list[float]:
    data = torch.randint(0, 120, (steps, 8, 17), generator=torch.Generator().manual_seed(3))
    dp, r = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    losses = []
    for x in data[:, r * 8 // dp:(r + 1) * 8 // dp]:
        loss = engine(x[:, :-1], labels=x[:, 1:]).mean()
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _ring_order(count: int):
    engine = _engine({"device": "cpu", "buffer_count": count, "buffer_size": ALIGN}, hidden_size=64)
    off = engine.offload
    off.events = []
    _train(engine, 1)
    chunks = sorted({i for _, i, _, _ in off.events})
    at = {(kind, i): (t0, t1) for kind, i, t0, t1 in off.events}
    in_flight = []
    for i in chunks:
        assert at["fetch", i][1] <= at["step", i][0] <= at["step", i][1] <= at["return", i][0], i
        in_flight.append((at["fetch", i][0], at["return", i][1]))
    # Never more chunks between "fetch started" and "return finished" than ring buffers.
    worst = max(sum(1 for a, b in in_flight if a <= t < b) for t, _ in in_flight)
    return len(chunks), worst


def test_ring_keeps_stage_order_and_at_most_buffer_count_chunks_in_flight():
    out = run_distributed(1, _ring_order, 2)
    chunks, worst = out[0]
    assert chunks >= 6 and worst <= 2, (chunks, worst)


def _overlap(count: int):
    """Hold stages open until their neighbours have run beside them: chunk i's step ends only after
    chunk i+1 has arrived, and (three buffers or more) chunk i-1's return only after chunk i has
    stepped. A pipeline finishes; a loop that runs one stage at a time waits (30 s, then fails)."""
    engine = _engine({"device": "cpu", "buffer_count": count, "buffer_size": ALIGN}, hidden_size=64)
    off = engine.offload
    chunks = sum(-(-g.shard_numel // off.chunk) for g in off.groups)
    done, changed = set(), threading.Condition()

    def hold(kind: str, i: int) -> None:
        wanted = {"step": ("fetch", i + 1), "return": ("step", i + 1)}.get(kind)
        if wanted is None or wanted[1] >= chunks or (kind == "return" and count < 3):
            wanted = None  # with two buffers chunk i+1 arrives only after chunk i-1 has left
        with changed:
            if wanted is not None and not changed.wait_for(lambda: wanted in done, timeout=30):
                raise AssertionError(f"{kind} of chunk {i} ran alone: {wanted} never ran beside it")
            done.add((kind, i))
            changed.notify_all()

    off.stage_hook = hold
    grads = {g: torch.zeros(g.shard_numel) for g in off.groups}
    off.init_state(engine.optimizer, off.groups[0])
    off.step(engine.optimizer, grads, 1.0)
    return chunks, len(done)


@pytest.mark.parametrize("count", [2, 3])
def test_each_chunk_steps_while_the_next_arrives_and_the_last_leaves(count):
    chunks, stages = run_distributed(1, _overlap, count)[0]
    assert chunks >= 6 and stages == 3 * chunks, (chunks, stages)


def _bytes(device: str, path: str | None):
    off = {"device": device, "buffer_count": 3, "buffer_size": 2 * ALIGN}
    if path:
        off["nvme_path"] = path
    engine = _engine(off, bf16=True)
    before = engine.model_state_bytes()
    _train(engine, 1)
    after = engine.model_state_bytes()
    part = sum(g.shard_numel for g in engine.trainable_groups)
    return before, after, part, engine.offload.chunk


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_host_bytes_are_the_state_and_the_ring(device, tmp_path):
    before, after, part, chunk = run_distributed(1, _bytes, device, str(tmp_path) if device == "nvme" else None)[0]
    assert after["optimizer"] == 0  # nothing of the optimizer on the device
    width = 4 if device == "nvme" else 1  # the gradient (+ master and moments streamed from the files)
    assert after["host_ring"] == 3 * chunk * 4 * width
    if device == "cpu":
        # master and both moments from the start: one host allocation holds them all
        assert before["host_optimizer"] == after["host_optimizer"] == 12 * part
    else:
        assert after["host_optimizer"] == 0 and after["nvme"] == 12 * part


def _files(path: str):
    names = []
    for _ in range(2):  # a second run (a new engine) reuses the first one's files
        engine = _engine({"device": "nvme", "nvme_path": path})
        _train(engine, 1)
        directory = engine.offload.directory
        names.append(sorted(os.listdir(directory)))
        groups = len(engine.offload.groups)
        engine.offload.release()
        del engine
        mpu.destroy_model_parallel()
    return names, groups


def test_nvme_files_are_reused_not_accumulated(tmp_path):
    names, groups = run_distributed(1, _files, str(tmp_path))[0]
    assert names[0] == names[1]
    assert len(names[0]) == 1 + 3 * groups  # the lock, and a master and two moments per group


def _two_jobs(path: str):
    first = _engine({"device": "nvme", "nvme_path": path})
    mpu.destroy_model_parallel()
    try:
        _engine({"device": "nvme", "nvme_path": path})
    except RuntimeError as e:
        return str(e)
    finally:
        first.offload.release()
    return "accepted"


def test_a_second_live_job_on_the_same_nvme_path_is_refused(tmp_path):
    assert "in use by another process" in run_distributed(1, _two_jobs, str(tmp_path))[0]


def _model_only_load(device: str, path: str):
    """Weights written into the engine after training (a model-only load) reach the step: the
    offloaded masters are the ones written, not stale copies."""
    results = []
    for off in (None, {"device": device, **({"nvme_path": path} if device == "nvme" else {})}):
        engine = _engine(off, bf16=True)
        _train(engine, 1)
        fresh = {k: torch.full_like(v, 0.01) for k, v in engine.consolidated_state_dict().items()}
        engine.load_full_weights(lambda name: fresh[name])
        results.append((_train(engine, 1), engine.consolidated_state_dict()))
        if engine.offload is not None:
            engine.offload.release()
        mpu.destroy_model_parallel()
    (la, wa), (lb, wb) = results
    return la == lb and all(torch.equal(wa[k], wb[k]) for k in wa)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_model_only_load_refreshes_the_offloaded_masters(device, tmp_path):
    assert run_distributed(1, _model_only_load, device, str(tmp_path))[0]


def test_config_is_deepspeeds_schema_and_refuses_what_cannot_work(tmp_path):
    cfg = load_config({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path), "pin_memory": True, "buffer_count": 5, "ratio": 0.3,
        "fast_init": False, "pipeline_read": True}}}).zero_optimization.offload_optimizer
    assert (cfg.device, cfg.buffer_count, cfg.ratio, cfg.pin_memory) == ("nvme", 5, 0.3, True)
    zero_ratio = load_config({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu", "ratio": 0}}})
    assert not zero_ratio.zero_optimization.offload_optimizer.enabled  # ratio 0: nothing leaves the device
    for bad, words in [({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "needs stage 1, 2 or 3"),
                       ({"stage": 2, "offload_optimizer": {"device": "nvme"}}, "needs zero_optimization"),
                       ({"stage": 2, "offload_optimizer": {"device": "disk"}}, "must be none, cpu or nvme"),
                       ({"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 2}}, "must be in [0, 1]")]:
        with pytest.raises(ZeroConfigError, match=words.replace("[", r"\[").replace("]", r"\]")):
            load_config({"zero_optimization": bad})
    with pytest.raises(ZeroConfigError, match="SGD"):
        load_config({"optimizer": {"type": "SGD"}, "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}})


# ---------------------------------------------------------------- offload_param (ZeRO-3)

def _param_bytes(param: dict, opt: dict | None, bf16: bool):
    engine = _engine(opt, stage=3, bf16=bf16, param=param)
    _train(engine, 1)
    po = engine.param_offload
    part = sum(g.shard_numel for g in po.groups)
    elem = 2 if bf16 else 4
    aliased = [g.shard is g.master and g.shard.device.type == "cpu" for g in po.groups if id(g) in po.aliased]
    held = [g.shard_numel * elem for g in po.groups if g not in po.on_nvme and id(g) not in po.aliased]
    padded = sum(-(-b // ALIGN_BYTES) * ALIGN_BYTES for b in held)  # each view starts aligned
    return (engine.model_state_bytes(), part * elem, len(po.ring), po.chunk_bytes, len(po.aliased), aliased,
            sum(held), padded, po.arena.nbytes)


@pytest.mark.parametrize("bf16", [False, True])
def test_param_offload_holds_the_partition_off_the_device(bf16, tmp_path):
    cpu = {"device": "cpu"}
    for state, part, _, _, _, _, held, padded, arena in run_distributed(2, _param_bytes, cpu, None, bf16):
        assert state["params"] == 0 and held == part and state["nvme_params"] == 0
        assert state["host_params"] == padded == arena  # what the host allocation really holds
    # NVMe: the first max_in_cpu elements in host memory, the rest in files, reads through the ring
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 3000, "buffer_count": 2, "buffer_size": 500}
    for state, part, count, chunk, _, _, held, padded, arena in run_distributed(2, _param_bytes, nvme, None, bf16):
        elem = 2 if bf16 else 4
        assert state["params"] == 0 and held + state["nvme_params"] == part
        assert 0 < held <= 3000 * elem and state["nvme_params"] > 0 and state["host_params"] == padded
        ring = -(-500 * elem // ALIGN_BYTES) * ALIGN_BYTES
        assert count == 2 and chunk == 500 * elem and state["host_param_ring"] == 2 * ring
        assert state["host_params"] + state["host_param_ring"] == arena


def test_fp32_partitions_are_the_host_masters_when_the_optimizer_is_offloaded():
    for state, part, _, _, n_aliased, aliased, *_ in run_distributed(2, _param_bytes, {"device": "cpu"},
                                                                  {"device": "cpu"}, False):
        assert n_aliased > 0 and all(aliased)
        # nothing on the device but the gradient partition; the host holds each element's 12 B once
        assert state["params"] == 0 and state["optimizer"] == 0 and state["host_params"] == 0
        assert state["host_optimizer"] == 3 * part


def _param_model_only_load(param: dict | None):
    engine = _engine(None, stage=3, bf16=True, param=param)
    _train(engine, 1)
    fresh = {k: torch.full_like(v, 0.01) for k, v in engine.consolidated_state_dict(rank0_only=False).items()}
    engine.load_full_weights(lambda name: fresh[name])
    losses = _train(engine, 1)
    if engine.param_offload is not None:
        engine.param_offload.release()
    return losses, engine.consolidated_state_dict(rank0_only=False)


@pytest.mark.parametrize("device", ["cpu", "nvme"])
def test_model_only_load_refreshes_the_offloaded_partitions(device, tmp_path):
    """Weights loaded after training reach the next forward through the offloaded partitions."""
    param = {"device": device, **({"nvme_path": str(tmp_path), "max_in_cpu": 0} if device == "nvme" else {})}
    ref = run_distributed(2, _param_model_only_load, None)
    got = run_distributed(2, _param_model_only_load, param)
    for (la, wa), (lb, wb) in zip(ref, got):
        assert la == lb and all(torch.equal(wa[k], wb[k]) for k in wa)
