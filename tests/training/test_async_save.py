"""``--async-save``: checkpoints written by a background thread while training goes on.

Through ``pretrain_gpt.py`` (``tests/launch.py``): at pp 2 and at dp 2 with ZeRO-3 the background
saves hold the same bytes as the synchronous ones, in both formats (torch_dist's at tp 2 x dp 2)
(every file's sha256 in the manifest; config.json
differs only in the flag itself), the losses are identical, and resuming from either gives the same
next losses. A write failing on one rank ends the run with that rank's one message and leaves
``latest`` on the previous checkpoint; a SIGKILL during a background write (training having gone on
past it) leaves ``latest`` on the previous checkpoint, from which the run resumes. The staged copies
are the state at the save, whatever the step does to the live tensors during the write.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.distributed import run_distributed
from tests.launch import ROOT, _main_on_rank
from tests.training.test_layout_invariance import flags, launch, write_corpus

DRILL = "tests.training.async_save_drill"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("async_data"))


def _manifest(save, iteration: int) -> dict:
    return json.load(open(os.path.join(str(save), f"iter_{iteration:07d}", "manifest.json")))["files"]


def _assert_same_checkpoint(a, b, iteration: int) -> None:
    """Checkpoints ``a/ckpt`` and ``b/ckpt`` of runs in directories ``a`` (sync) and ``b`` (--async-save)."""
    fa, fb = _manifest(a / "ckpt", iteration), _manifest(b / "ckpt", iteration)
    assert sorted(fa) == sorted(fb)
    differ = [name for name in fa if fa[name]["sha256"] != fb[name]["sha256"]]
    assert differ == ["config.json"], differ  # the flag itself (and the run's directory)
    ca, cb = (json.loads(open(d / "ckpt" / f"iter_{iteration:07d}" / "config.json").read().replace(str(d), "RUN"))
              for d in (a, b))
    assert cb["checkpoint"].pop("async_save") is True and ca["checkpoint"].pop("async_save") is False
    assert ca == cb


def _losses(records: dict) -> dict[int, float]:
    return {it: r["lm_loss"] for it, r in records.items()}


@pytest.mark.parametrize("layout", [["--pp", "2"], ["--zero-stage", "3"]], ids=["pp2", "dp2_zero3"])
def test_background_saves_equal_synchronous_ones(data, tmp_path, layout):
    runs = {}
    for mode, extra in (("sync", []), ("async", ["--async-save"])):
        (tmp_path / mode).mkdir()
        save = tmp_path / mode / "ckpt"
        runs[mode] = launch(2, flags(data, *layout, "--save", str(save), "--save-interval", "2", *extra, iters=5),
                            tmp_path / mode, "run")
    assert _losses(runs["async"]) == _losses(runs["sync"])
    for it in (2, 4, 5):  # interval saves and the one at the end
        _assert_same_checkpoint(tmp_path / "sync", tmp_path / "async", it)
    assert open(tmp_path / "async" / "ckpt" / "latest").read().strip() == "iter_0000005"
    log = open(tmp_path / "async" / "run.log").read()
    assert "writing it in the background" in log and "MiB of host memory per rank" in log
    resumed = {mode: launch(2, flags(data, *layout, "--load", str(tmp_path / mode / "ckpt"), "--ckpt-step", "2",
                                     iters=5), tmp_path, f"resumed_{mode}") for mode in ("sync", "async")}
    assert sorted(resumed["async"]) == [3, 4, 5]
    assert _losses(resumed["async"]) == _losses(resumed["sync"])


def test_background_torch_dist_saves_equal_synchronous_ones(data, tmp_path):
    """--ckpt-format torch_dist at tp 2 x dp 2 with ZeRO-3: the .distcp files and DCP's .metadata are the same
    bytes written in the background; megazero's resume from either continues alike."""
    runs = {}
    for mode, extra in (("sync", []), ("async", ["--async-save"])):
        (tmp_path / mode).mkdir()
        argv = flags(data, "--tp", "2", "--zero-stage", "3", "--save", str(tmp_path / mode / "ckpt"),
                     "--save-interval", "2", "--ckpt-format", "torch_dist", *extra, iters=4)
        runs[mode] = launch(4, argv, tmp_path / mode, "run")
    assert _losses(runs["async"]) == _losses(runs["sync"])
    for it in (2, 4):
        a, b = (tmp_path / mode / "ckpt" / f"iter_{it:07d}" for mode in ("sync", "async"))
        names = sorted(n for n in os.listdir(a) if n.endswith(".distcp") or n == ".metadata")
        assert names == sorted(n for n in os.listdir(b) if n.endswith(".distcp") or n == ".metadata")
        assert len(names) == 6 and all(open(a / n, "rb").read() == open(b / n, "rb").read() for n in names)
    assert (tmp_path / "async" / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == "4"
    resumed = {mode: launch(2, flags(data, "--pp", "2", "--load", str(tmp_path / mode / "ckpt"), "--ckpt-step", "2",
                                     iters=4), tmp_path, f"resumed_{mode}") for mode in ("sync", "async")}
    assert sorted(resumed["async"]) == [3, 4] and _losses(resumed["async"]) == _losses(resumed["sync"])


def test_failed_background_write_ends_the_run_with_its_message(data, tmp_path):
    save = tmp_path / "ckpt"
    argv = flags(data, "--save", str(save), "--save-interval", "2", "--async-save", "--zero-stage", "2", iters=6)
    results = run_distributed(2, _main_on_rank, DRILL, argv + ["--metrics-file", str(tmp_path / "m.jsonl")],
                              str(tmp_path), {"MEGAZERO_TEST_ASYNC_WRITE": "fail:1:2"}, None)
    assert [rc for rc, _, _ in results] == [1, 1]
    out = "".join(o + e for _, o, e in results)
    line = "checkpoint save failed on rank 1: cannot write iter_0000004.partial: permission denied (injected)"
    assert out.count(line) == 1, out[-3000:]
    assert open(save / "latest").read().strip() == "iter_0000002"
    assert not os.path.exists(save / "iter_0000004")


def test_kill_during_background_write_keeps_latest_and_resumes(data, tmp_path):
    save, marker, metrics = tmp_path / "ckpt", tmp_path / "writing", tmp_path / "m.jsonl"
    argv = flags(data, "--save", str(save), "--load", str(save), "--save-interval", "2", "--async-save", iters=8)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=ROOT, MEGAZERO_TEST_ASYNC_WRITE=f"hang:0:2:{marker}")
    with open(tmp_path / "log.txt", "w") as log:
        proc = subprocess.Popen([sys.executable, os.path.join(ROOT, *DRILL.split(".")) + ".py", *argv,
                                 "--metrics-file", str(metrics)], env=env, cwd=str(tmp_path), stdout=log,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 120
        while not (marker.exists() and _iterations(metrics) >= 5):  # the write of iteration 4 hangs, steps go on
            assert proc.poll() is None and time.time() < deadline, open(tmp_path / "log.txt").read()[-3000:]
            time.sleep(0.1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert open(save / "latest").read().strip() == "iter_0000002"
    assert not os.path.exists(save / "iter_0000004")
    records = launch(1, argv, tmp_path, "resumed")
    assert sorted(records) == list(range(3, 9))
    assert "resumed from iteration 2" in open(tmp_path / "resumed.log").read()
    assert open(save / "latest").read().strip() == "iter_0000008"


def _iterations(metrics) -> int:
    if not os.path.exists(metrics):
        return 0
    its = [json.loads(line).get("iteration", 0) for line in open(metrics) if line.strip().endswith("}")]
    return max(its, default=0)


def _staged_then_changed(directory: str) -> bool:
    """A staged save holds the state at staging: the live masters and moments change before its write."""
    from megazero.checkpoint.native import stage_checkpoint
    from megazero.utils.phase_agreement import attempt
    from megazero.checkpoint.async_save import finish_write, writer_group
    from megazero.zero.checkpoint import shard_file
    from safetensors.torch import load_file
    from tests.zero.test_checkpoint_io import _engine, _step

    engine = _engine(1, 1)
    _step(engine)
    before = {f"g{i}.{k}": (g.master if k == "master" else engine.optimizer.state[g.master][k]).clone()
              for i, g in enumerate(engine.groups) for k in ("master", "exp_avg", "exp_avg_sq")}
    pending = stage_checkpoint(directory, 1, engine, train_state={"iteration": 1}, config={}, group=writer_group())
    held = sum(t.numel() * 4 for t in before.values())
    assert held <= pending.host_bytes < held + 65536  # the partitions plus the RNG states
    from megazero.model import GPTModel
    from megazero.observe.planner import estimate_memory
    from tests.zero.test_checkpoint_io import MODEL
    from tests.zero.common import tiny_config

    planned = estimate_memory(tiny_config(**MODEL), tp=1, dp=2, zero_stage=1, micro_batch_size=1,
                              async_save=True).host_checkpoint  # what the planner counts for it
    whole = sum(p.numel() for p in GPTModel(tiny_config(**MODEL), device="meta").parameters())
    assert planned == 12 * whole / 2 and abs(planned - held) <= 0.01 * held, (planned, held)
    _step(engine)  # the step changes the live tensors before the write
    _, failure = attempt(pending.write)
    finish_write(pending, failure)
    saved = load_file(shard_file(os.path.join(directory, "iter_0000001"), torch.distributed.get_rank()))
    return all(torch.equal(saved[k], v) for k, v in before.items()) and not torch.equal(
        engine.groups[0].master, before["g0.master"])


def test_staged_save_holds_the_state_at_staging(tmp_path):
    assert run_distributed(2, _staged_then_changed, str(tmp_path)) == [True, True]
