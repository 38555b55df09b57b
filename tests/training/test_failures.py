"""A failure stops every rank with one clear line; skipped fp16 steps do not advance the LR schedule;
a checkpoint loaded in another precision starts the loss scaler from its configured scale."""

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.launch import ROOT
from tests.training.test_e2e import argv
from tests.distributed import _free_port


def _launch(world, args, tmp_path, timeout=90):
    """``world`` processes of pretrain_gpt.py, as torchrun would start them; returns (codes, stderr, seconds)."""
    port = _free_port()
    procs = []
    t0 = time.time()
    for r in range(world):
        env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r), MASTER_ADDR="127.0.0.1",
                   MASTER_PORT=str(port), OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
        procs.append(subprocess.Popen([sys.executable, os.path.join(ROOT, "pretrain_gpt.py"), *args], env=env,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT))
    try:
        errs = [p.communicate(timeout=timeout)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [p.returncode for p in procs], "".join(errs), time.time() - t0


def _broken_copy(prefix, tmp_path, how):
    out = str(tmp_path / "broken_text_document")
    bin_, idx = open(prefix + ".bin", "rb").read(), open(prefix + ".idx", "rb").read()
    if how == "truncated-bin":
        bin_ = bin_[: len(bin_) // 2]
    else:  # an index of another format (e.g. a fairseq .idx)
        idx = b"TNTIDX\x00\x00" + idx[8:]
    open(out + ".bin", "wb").write(bin_)
    open(out + ".idx", "wb").write(idx)
    return out


@pytest.mark.parametrize("how,message", [("truncated-bin", "broken_text_document"), ("foreign-idx", "broken_text_document.idx")])
def test_bad_data_prints_one_line_and_every_rank_exits(dataset, tmp_path, how, message):  
    prefix = _broken_copy(dataset, tmp_path, how)
    args = argv(prefix, tp=1, stage=1, iters=2)
    codes, err, seconds = _launch(2, args, tmp_path)
    lines = [line for line in err.splitlines() if line.strip()]
    assert all(c == 1 for c in codes), (codes, err)
    assert "Traceback" not in err and len(lines) == 1, err
    assert lines[0].startswith("pretrain_gpt.py: data set-up failed on rank") and message in lines[0], err
    assert seconds < 60


def _fp16_run(args, world, overflow_at):
    import megazero.zero.engine as engine_mod
    from megazero.config import parse_args
    from megazero.training.trainer import pretrain

    original, calls = engine_mod.ZeroEngine._sum_squares, [0]

    def injected(self, grads):
        total = original(self, grads)  # keep the collectives of every rank matched
        calls[0] += 1
        return float("inf") if calls[0] in overflow_at else total

    engine_mod.ZeroEngine._sum_squares = injected
    try:
        pretrain(parse_args(args, world))
    finally:
        engine_mod.ZeroEngine._sum_squares = original


def test_lr_schedule_counts_only_successful_updates(dataset, tmp_path):
    lrs = {}
    for name, overflow in (("clean", ()), ("skips", (2, 3, 5))):
        save = tmp_path / name
        # a scale that never overflows by itself (Megatron's default, 2^32, skips the first ~20 steps)
        args = argv(dataset, "--fp16", "--initial-loss-scale", "1024", "--save", str(save), "--save-interval", "100",
                    "--log-interval", "1",
                    "--lr-warmup-iters", "4", "--eval-interval", "0", tp=1, stage=1, iters=8)
        run_distributed(2, _fp16_run, args, 2, set(overflow))
        records = [json.loads(line) for line in open(save / "metrics.jsonl")]
        lrs[name] = {m["iteration"]: m["lr"] for m in records if "lr" in m}
    # After 8 iterations with 3 skipped steps the schedule stands where a clean run is after 5.
    assert lrs["skips"][8] == pytest.approx(lrs["clean"][5], rel=1e-12)
    assert lrs["skips"][8] != pytest.approx(lrs["clean"][8])


def _resume_in_other_precision(src, save, extra):
    from megazero.config import parse_args
    from megazero.training.loop import Callback
    from megazero.training.trainer import pretrain

    seen = {}

    class Loaded(Callback):
        def on_load(self, loaded):
            seen["note"] = loaded.get("scaler_note")

        def on_train_start(self, state, run):  # right after the load, before any step
            seen["scale"] = run.engine.get_loss_scale()

    pretrain(parse_args(extra, 2), callbacks=[Loaded()])
    return seen


def test_precision_change_starts_the_loss_scaler_from_the_configured_scale(dataset, tmp_path):
    src = tmp_path / "bf16"
    run_distributed(2, _pretrain_plain, argv(dataset, "--bf16", "--save", str(src), "--exit-interval", "2",
                                                  tp=1, stage=1, iters=3), 2)
    args = argv(dataset, "--fp16", "--initial-loss-scale", "4096", "--load", str(src), "--save", str(tmp_path / "b"),
                tp=1, stage=1, iters=3)
    seen = run_distributed(2, _resume_in_other_precision, src, tmp_path / "b", args)[0]
    assert seen["scale"] == 4096.0
    assert "saved in bfloat16" in seen["note"] and "float16" in seen["note"]


def _pretrain_plain(args, world):
    from megazero.config import parse_args
    from megazero.training.trainer import pretrain

    pretrain(parse_args(args, world))
