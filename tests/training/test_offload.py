"""Optimizer and parameter offload through what a user runs: ``pretrain_gpt.py`` with and without it, on the
ranks ``torchrun`` would start (``tests/launch.py``; the drive-error cases start the real ``torchrun``).

On a CPU machine the offloaded step uses the kernel the accelerator's step uses (torch's fused
CPU AdamW, chunked at multiples of 4096 elements), so a run with offload must be *bit-identical*
to the same command without it: losses and grad norms in the metrics file, and every saved
tensor (fp32 masters, both Adam moments) of every rank's checkpoint shard. Cells:

* dp 2, ZeRO-1, fp32, Megatron-core's ``--optimizer-cpu-offload``, accumulation 2, clipping, with
  ``--log-params-norm`` and ``--log-num-zeros-in-grad`` (which read the offloaded masters and gradients);
* pp 2 x dp 2, ZeRO-3, bf16, the DeepSpeed JSON's ``offload_optimizer`` on the host with
  ``ratio`` 0.5 and a two-buffer ring, and ``offload_param`` on the host;
* tp 2 x dp 2, ZeRO-2, fp16 with forced overflows (skipped steps, then trained ones), NVMe (files), ratio 1;
* tp 2 x dp 2, ZeRO-3, fp32, ``offload_param`` on NVMe (part of the partition in host memory,
  ``max_in_cpu``) with half the optimizer on the host (its masters are those groups' partitions);
* checkpoints cross over: the NVMe run resumes from the checkpoint saved without offload and
  equals the uninterrupted run bit for bit; one process without offload resumes from the
  checkpoint saved with it and continues the dp 2 run to float rounding.
"""

from __future__ import annotations

import glob
import json
import os
import re

import pytest
import torch

from tests.training.test_layout_invariance import RTOL, assert_same_run, flags, launch, write_corpus


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("offload_data"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("offload_runs")


def shard_tensors(save_dir, iteration: int) -> dict[str, torch.Tensor]:
    """Every tensor of every rank's ZeRO shard at ``iteration``: masters and optimizer moments."""
    from safetensors.torch import load_file

    out = {}
    for path in sorted(glob.glob(os.path.join(str(save_dir), f"iter_{iteration:07d}", "zero_rank*.safetensors"))):
        for key, value in load_file(path).items():
            out[f"{os.path.basename(path)}:{key}"] = value
    assert out, f"no ZeRO shards under {save_dir} at iteration {iteration}"
    return out


def assert_bit_identical(got: dict, ref: dict, got_dir, ref_dir, iteration: int, what: str) -> None:
    assert sorted(got) == sorted(ref), (what, sorted(got), sorted(ref))
    for it in ref:
        for key in ("lm_loss", "grad_norm", "loss_scale", "params_norm", "num_zeros"):
            if key in ref[it]:
                assert got[it][key] == ref[it][key], f"{what}: iteration {it} {key} {got[it][key]} vs {ref[it][key]}"
    a, b = shard_tensors(got_dir, iteration), shard_tensors(ref_dir, iteration)
    assert sorted(a) == sorted(b), what
    assert iteration < 4 or any(".exp_avg" in k for k in a), f"{what}: no optimizer moments saved"
    for key in b:
        assert torch.equal(a[key], b[key]), f"{what}: {key} differs from the run without offload"


# The test model's parameters are all below DeepSpeed's persistence threshold (1e5 elements), which
# keeps them gathered and so never offloaded: partition every one.
EVERY_PARAM_PARTITIONED = {"stage3_param_persistence_threshold": 0}
CELLS = {
    # name: (world, flags, the JSON's zero_optimization offload blocks for the offloaded run, or None (flags only))
    "z1_dp2_fp32_flag": (2, ["--zero-stage", "1", "--optimizer-cpu-offload", "--log-params-norm",
                             "--log-num-zeros-in-grad"], None),
    "z3_pp2_dp2_bf16_ratio_params": (4, ["--pp", "2", "--zero-stage", "3", "--bf16"], {
        "offload_optimizer": {"device": "cpu", "ratio": 0.5, "buffer_count": 2, "buffer_size": 4096},
        "offload_param": {"device": "cpu"}, **EVERY_PARAM_PARTITIONED}),
    "z2_tp2_dp2_fp16_overflow_nvme": (4, ["--tp", "2", "--zero-stage", "2", "--fp16", "--initial-loss-scale",
                                          str(2 ** 18)], {"offload_optimizer": {"device": "nvme", "buffer_size": 8192}}),
    # ZeRO-Infinity: parameters on NVMe (the first 2,000 elements of the partition in host memory),
    # read through a ring of three 1,000-element buffers; fp32 with half the optimizer on the host,
    # whose masters are then those groups' partitions (no copy), the other half on the device.
    "z3_tp2_dp2_fp32_params_nvme": (4, ["--tp", "2", "--zero-stage", "3", "--log-params-norm"], {
        "offload_optimizer": {"device": "cpu", "ratio": 0.5},
        "offload_param": {"device": "nvme", "max_in_cpu": 2000, "buffer_count": 3, "buffer_size": 1000},
        **EVERY_PARAM_PARTITIONED}),
}


def _cell_flags(runs, name: str, offloaded: bool) -> list[str]:
    world, extra, block = CELLS[name]
    extra = [x for x in extra if offloaded or x != "--optimizer-cpu-offload"]
    tag = f"{name}_{'off' if offloaded else 'ref'}"
    if block is not None:  # the reference run gets the same JSON without its offload blocks
        block = {key: dict(value, nvme_path=str(runs / f"{name}_nvme"))
                 if isinstance(value, dict) and value["device"] == "nvme" else value
                 for key, value in block.items() if offloaded or not key.startswith("offload_")}
        path = runs / f"{tag}.json"
        path.write_text(json.dumps({"zero_optimization": block}))
        extra = extra + ["--deepspeed_config", str(path)]
    return flags_for(runs, tag, extra), tag


def flags_for(runs, tag: str, extra: list[str]) -> list[str]:
    return [*extra, "--save", str(runs / tag), "--save-interval", "2"]


@pytest.fixture(scope="module")
def cells(data, runs):
    out = {}
    for name, (world, _, _) in CELLS.items():
        for offloaded in (False, True):
            extra, tag = _cell_flags(runs, name, offloaded)
            out[tag] = launch(world, flags(data, *extra), runs, tag)
    return out


@pytest.mark.parametrize("name", sorted(CELLS))
def test_offload_is_bit_identical_to_the_run_without(cells, runs, name):
    ref, got = cells[f"{name}_ref"], cells[f"{name}_off"]
    if "overflow" in name:  # at scale 2^18 the first steps' fp16 gradients overflow and are skipped
        assert 0 < len(ref) < 4, f"expected skipped and trained steps, got the iterations {sorted(ref)}"
    for iteration in (2, 4):
        assert_bit_identical(got, ref, runs / f"{name}_off", runs / f"{name}_ref", iteration, name)
    # Not vacuous: the offloaded run says what it moved off the device, the reference nothing.
    assert "; offloaded: host" in (runs / f"{name}_off.log").read_text()
    assert "; offloaded:" not in (runs / f"{name}_ref.log").read_text()


def test_nvme_files_have_stable_names(cells, runs):
    files = sorted(os.listdir(runs / "z2_tp2_dp2_fp16_overflow_nvme_nvme" / "megazero_offload" / "rank00003"))
    assert "lock" in files and any(f.endswith(".exp_avg_sq.fp32") for f in files), files
    assert not any(f.isdigit() for f in files)
    params = runs / "z3_tp2_dp2_fp32_params_nvme_nvme" / "megazero_offload" / "rank00003" / "params"
    files = sorted(os.listdir(params))
    assert "lock" in files and any(f.endswith(".param.fp32") for f in files), files


def test_checkpoints_cross_between_offload_and_none(cells, data, runs):
    """Saved without offload, resumed with NVMe offload at the same layout: bit-identical to the
    uninterrupted run. Saved with offload, resumed without it in one process: the one-process losses."""
    name = "z1_dp2_fp32_flag"
    nvme = runs / "resume.json"
    nvme.write_text(json.dumps({"zero_optimization": {"offload_optimizer": {"device": "nvme",
                                                                            "nvme_path": str(runs / "resume_nvme")}}}))
    got = launch(2, flags(data, "--zero-stage", "1", "--log-params-norm", "--log-num-zeros-in-grad",
                          "--deepspeed_config", str(nvme), "--load", str(runs / f"{name}_ref"),
                          "--ckpt-step", "2", "--save", str(runs / "resumed_nvme")), runs, "resumed_nvme")
    tail = {it: r for it, r in cells[f"{name}_ref"].items() if it > 2}
    assert_bit_identical(got, tail, runs / "resumed_nvme", runs / f"{name}_ref", 4, "nvme resume of a plain checkpoint")

    # One process (dp 1) without offload, from the dp 2 offloaded run's checkpoint: the dp 2 run's next
    # losses to float rounding (the layouts differ, so not bit for bit).
    got = launch(1, flags(data, "--load", str(runs / f"{name}_off"), "--ckpt-step", "2"), runs, "resumed_plain")
    assert_same_run(got, tail, rtol=RTOL, what="plain resume of an offloaded run")


def _rehearsed_with_plan(tmp_path, name: str, flags: list[str], stage: int):
    """tools/rehearse.py's rank 0 at 16 ranks of the 1.3B test GPT (bf16) with ``flags``, the
    planner's estimate for the same command, the ZeRO formulas' (weights, grads, optimizer) and the
    tool's output."""
    from megazero.observe.planner import estimate_memory_for, model_state_bytes
    from megazero.observe.rehearsal import rehearsal_config
    from tests.training.test_rehearse import MODEL, WORLD, _rehearse

    code, doc, out = _rehearse(tmp_path, name, flags, "--ranks", "0", "--micro-batches", "1")
    assert code == 0, out
    config, _ = rehearsal_config(MODEL + flags, WORLD)
    est = estimate_memory_for(config)
    formula = model_state_bytes(est.params_per_rank, dp=config.parallel.dp, zero_stage=stage, precision="bf16")
    return doc["ranks"][0], est, formula, out


def test_rehearsal_and_plan_report_host_bytes_apart(tmp_path):
    """tools/rehearse.py at 16 ranks of a 1.3B GPT, ZeRO-2 with --optimizer-cpu-offload: the device
    holds no optimizer state (the ZeRO formulas minus 12 B per partition element), the host the
    12 B and the ring, as the planner says; the estimate tool prints both."""
    import sys

    from tests import background
    from tests.training.test_rehearse import MODEL, ROOT, WORLD

    flags = ["--tp", "2", "--zero-stage", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
             "--optimizer-cpu-offload"]
    # the estimate tool's process beside the rehearsal's (each single-threaded)
    estimate = background.run([sys.executable, str(ROOT / "tools" / "estimate_memory.py"), "--world-size", str(WORLD),
                               "--train-args", *MODEL, *flags, "--mock-data", "--train-iters", "2"],
                              {"PYTHONPATH": str(ROOT)}, timeout=300, cwd=str(ROOT))
    r, est, (weights, grads, optim), out = _rehearsed_with_plan(tmp_path, "offload", flags, 2)
    assert est.optimizer == 0 and est.host_optimizer == pytest.approx(optim)  # 12 B per partition element
    assert r["state_bytes"] == pytest.approx(weights + grads, rel=0.05)
    assert r["host_bytes"] == pytest.approx(est.host_total, rel=0.05)
    assert "host memory (offload)" in out
    text = estimate.result().stdout
    assert "per-rank host memory" in text and "offloaded optimizer" in text, text


def test_rehearsal_of_zero_infinity_holds_only_gradients_on_the_device(tmp_path):
    """tools/rehearse.py at 16 ranks of a 1.3B GPT, tp 2 x ZeRO-3, bf16, with the JSON's
    offload_param and offload_optimizer on the host: the device holds the gradient partition (and
    the small persistent parameters), the host the weights' 2 B and the optimizer's 12 B per
    partition element and the ring, within 5% of the plan."""
    ds = tmp_path / "ds_config.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                                    "offload_optimizer": {"device": "cpu"}}}))
    flags = ["--tp", "2", "--zero-stage", "3", "--micro-batch-size", "1", "--global-batch-size", "8",
             "--deepspeed_config", str(ds)]
    r, est, (weights, grads, optim), _ = _rehearsed_with_plan(tmp_path, "infinity", flags, 3)
    assert est.params == 0 and est.optimizer == 0 and est.host_params == pytest.approx(weights)
    assert r["state_bytes"] == pytest.approx(grads, rel=0.05)
    assert r["host_bytes"] == pytest.approx(est.host_total, rel=0.05)


# A drive error on one rank in the middle of a run: every rank must stop, promptly, with that rank's
# message, not wait in the collective the failing rank would have left (the gathers of the next
# forward, the step's all-gathers). Injected by a sitecustomize module torchrun's workers import:
# rank 1's os.preadv (and os.pwritev) start failing with EIO after the first ``after`` calls.
_FAULTY_DRIVE = '''
import errno, os
if os.environ.get("RANK") == "1":
    _calls = {"n": 0}
    def _faulty(real):
        def call(*args, **kwargs):
            _calls["n"] += 1
            if _calls["n"] > int(os.environ["MEGAZERO_TEST_IO_AFTER"]):
                raise OSError(errno.EIO, "Input/output error (injected)")
            return real(*args, **kwargs)
        return call
    os.preadv = _faulty(os.preadv)
    if os.environ["MEGAZERO_TEST_IO_WRITES"] == "1":
        os.pwritev = _faulty(os.pwritev)
'''


# The parameter cells read each partition whole (buffer_size as large as DeepSpeed's default): the
# counts of calls before the failure assume one read per partition per gather.
_WHOLE = {"device": "nvme", "max_in_cpu": 0, "buffer_size": 100_000_000}


@pytest.mark.parametrize("world,extra,block,after,writes", [
    (2, [], {"offload_param": _WHOLE}, 120, False),  # a parameter read in a gather
    (2, [], {"offload_optimizer": {"device": "nvme"}}, 30, True),  # a state read or write inside the offloaded step
    # pp 2 x dp 2: rank 1 (the first stage's second DP rank) fails mid-schedule, while its next stage
    # waits on its activations and its DP peer on its gathers.
    (4, ["--pp", "2"], {"offload_param": _WHOLE}, 20, False),
])
def test_a_drive_error_on_one_rank_stops_every_rank_with_its_message(data, tmp_path, monkeypatch, world, extra, block,
                                                                      after, writes):
    from tests.training.test_layout_invariance import run_cli

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_FAULTY_DRIVE)
    block = {**{k: dict(v, nvme_path=str(tmp_path / "nvme")) for k, v in block.items()}, **EVERY_PARAM_PARTITIONED}
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": block}))
    monkeypatch.setenv("MEGAZERO_TEST_IO_AFTER", str(after))
    monkeypatch.setenv("MEGAZERO_TEST_IO_WRITES", "1" if writes else "0")
    monkeypatch.setenv("PYTHONPATH", str(site) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = run_cli(world, flags(data, *extra, "--zero-stage", "3", "--deepspeed_config", str(cfg), iters=6), tmp_path,
                   str(tmp_path / "m.jsonl"), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    assert "failed on rank 1" in out and "Input/output error (injected)" in out, out[-3000:]
    phase = "reading the offloaded parameters" if "offload_param" in block else "the offloaded optimizer step"
    assert f"{phase} failed on rank 1" in out, out[-3000:]
    assert re.search(r"iteration\s+1/\s+6", out), "the drive should fail mid-run, after a first iteration"
    # Both ranks concluded together (RunAborted on each), not one rank dying while the other waits.
    assert "Timeout" not in out and "timed out" not in out, out[-3000:]
