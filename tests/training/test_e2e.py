"""End-to-end training on CPU: loss falls, exact resume, resharding, crash-safe saves, refusals."""

import json
import math
import os

import numpy as np
import pytest
import torch

from megazero.training.loop import Callback
from tests.distributed import run_distributed
from tests.helpers import VOCAB


def argv(prefix, *extra, tp=2, stage=3, iters=8, dropout=0.0):
    return ["--tp", str(tp), "--zero-stage", str(stage), "--num-layers", "2", "--hidden-size", "32",
            "--num-attention-heads", "4", "--seq-length", "16", "--max-position-embeddings", "16",
            "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", str(iters),
            "--lr", "5e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
            "--hidden-dropout", str(dropout), "--attention-dropout", str(dropout), "--seed", "7",
            "--data-path", prefix, "--split", "90,10,0", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB),
            "--make-vocab-size-divisible-by", "32", "--log-interval", "2", "--eval-interval", "4", "--eval-iters", "1",
            *extra]


class PoisonLoss(Callback):
    """A NaN in the loss of the ``at``-th iteration run here: its gradients are NaN, and the run must stop there."""

    def __init__(self, at):
        self.at, self.calls, self.run, self.loss_fn = at, 0, None, None

    def on_train_start(self, state, run):
        self.run = run

    def on_step_start(self, state, batches):
        self.calls += 1
        if self.calls == self.at:
            self.loss_fn = loss_fn = self.run.stage.loss_fn
            self.run.stage.loss_fn = lambda out, mb: loss_fn(out, mb) * float("nan")

    def on_step_end(self, state, result):
        if self.loss_fn is not None:
            self.run.stage.loss_fn, self.loss_fn = self.loss_fn, None


class CrashDuringSave(Callback):
    """A crash after this rank's files of a save from iteration ``at`` on are written, before the commit."""

    def __init__(self, at):
        self.at, self.iteration = at, 0

    def on_step_end(self, state, result):
        self.iteration = state.iteration

    def on_save_written(self, directory):
        if self.iteration >= self.at:
            raise RuntimeError("simulated crash in the middle of a save")


def _pretrain(args, world_size, patch_save_failure=False, nan_at_iteration=None):
    from megazero.config import parse_args
    from megazero.training.trainer import pretrain

    torch.manual_seed(0)
    callbacks = ([PoisonLoss(nan_at_iteration)] if nan_at_iteration is not None else []) + \
        ([CrashDuringSave(8)] if patch_save_failure else [])
    result = pretrain(parse_args(args, world_size), callbacks=callbacks)
    if callbacks:
        return result
    return result.losses, result.eval_losses, result.iteration


def run(world, args, **kw):
    return run_distributed(world, _pretrain, args, world, **kw)[0]


def test_loss_falls_tp2_dp2_zero3(dataset):
    losses, evals, it = run(4, argv(dataset, iters=40, dropout=0.1))
    assert it == 40
    first, last = np.mean([losses[i] for i in (1, 2, 3)]), np.mean([losses[i] for i in (38, 39, 40)])
    assert last < first - 1.0, (first, last)
    assert evals[40] < evals[4]


def test_save_exit_resume_equals_uninterrupted(dataset, tmp_path):
    # Dropout on: the RNG states of every rank must come back too.
    full, _, _ = run(4, argv(dataset, "--save", str(tmp_path / "a"), "--save-interval", "4", dropout=0.1))
    part1, _, it1 = run(4, argv(dataset, "--save", str(tmp_path / "b"), "--save-interval", "4",
                                "--exit-interval", "4", dropout=0.1))
    assert it1 == 4 and open(tmp_path / "b" / "latest").read().strip() == "iter_0000004"
    part2, _, it2 = run(4, argv(dataset, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b"), dropout=0.1))
    assert it2 == 8 and sorted(part2) == [5, 6, 7, 8]
    resumed = {**part1, **part2}
    for i in range(1, 9):
        assert resumed[i] == pytest.approx(full[i], abs=1e-6), (i, resumed[i], full[i])
    metrics = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    assert [m["iteration"] for m in metrics if "lm_loss" in m] == [2, 4, 6, 8]
    assert [m["iteration"] for m in metrics if "eval_lm_loss" in m] == [4, 8]  # the keys plot_metrics.py reads


@pytest.fixture(scope="module")
def reshard_source(dataset, tmp_path_factory):
    d = tmp_path_factory.mktemp("reshard")
    losses, _, _ = run(4, argv(dataset, "--save", str(d), "--save-interval", "4", iters=5))
    (d / "latest").write_text("iter_0000004\n")  # resume from 4; the run's own loss at 5 is the reference
    return d, losses


@pytest.mark.parametrize("world,tp,stage", [(4, 1, 1), (4, 4, 2), (1, 1, 0), (2, 2, 3)])
def test_reshard_checkpoint_to_other_layouts(dataset, reshard_source, tmp_path, world, tp, stage):
    src, reference = reshard_source
    # Resume the 2x2 ZeRO-3 checkpoint of iteration 4 at another tp x dp x stage.
    losses, _, it = run(world, argv(dataset, "--load", str(src), "--save", str(tmp_path), iters=5, tp=tp, stage=stage))
    assert it == 5 and sorted(losses) == [5]
    assert losses[5] == pytest.approx(reference[5], abs=2e-5), (losses[5], reference[5])


def test_crash_during_save_keeps_previous_checkpoint(dataset, tmp_path):
    with pytest.raises(AssertionError, match="simulated crash"):
        run(4, argv(dataset, "--save", str(tmp_path), "--save-interval", "4"), patch_save_failure=True)
    assert open(tmp_path / "latest").read().strip() == "iter_0000004"
    assert os.path.isdir(tmp_path / "iter_0000008.partial") and not os.path.exists(tmp_path / "iter_0000008")
    losses, _, it = run(4, argv(dataset, "--save", str(tmp_path), "--load", str(tmp_path)))
    assert it == 8 and sorted(losses) == [5, 6, 7, 8]


def test_tampered_checkpoint_is_refused(dataset, reshard_source, tmp_path):
    src, _ = reshard_source
    bad = tmp_path / "bad"
    import shutil

    shutil.copytree(src, bad)
    shard = bad / "iter_0000004" / "zero_rank00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-5] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(AssertionError, match="does not match its sha256"):
        run(4, argv(dataset, "--load", str(bad), iters=5))


@pytest.mark.parametrize("overrides,message", [
    ({"--tp": "3"}, "world size 4 is not divisible"),
    ({"--global-batch-size": "10"}, "10"),
    ({"--zero-stage": "4"}, "--zero-stage must be 0, 1, 2 or 3"),
    ({"--pp": "2", "--num-layers": "3"}, "--num-layers (3) is not divisible by the pipeline size (2)"),
    ({"--num-attention-heads": "6"}, "6"),
    ({"--data-path": "/nonexistent/prefix"}, "/nonexistent/prefix"),
])
def test_impossible_configurations_exit_before_any_collective(dataset, overrides, message, monkeypatch, capsys):
    """pretrain_gpt.py's main() as rank 0 of a 4-rank launch: exit 2 with the message, before any
    process group exists (so no rank can be left waiting in a collective)."""
    import torch.distributed as dist

    from megazero.cli.pretrain_gpt import main

    args = argv(dataset)
    for flag, value in overrides.items():
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag] if value is None else [flag, value]
    for key, value in {"WORLD_SIZE": "4", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exit_:
        main(args)
    err = capsys.readouterr().err
    assert exit_.value.code == 2, err
    assert not dist.is_initialized()
    assert message in err and "Traceback" not in err, err


def test_start_from_imported_hugging_face_weights(dataset, tmp_path):
    transformers = pytest.importorskip("transformers", reason="the HF import test needs transformers (requirements-test.txt)")
    from megazero.checkpoint.native import load_full_model

    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=VOCAB + 1, n_positions=16, n_embd=32,
                                                              n_layer=2, n_head=4))
    hf.save_pretrained(tmp_path / "hf")
    from megazero.cli.convert_from_hf import main as convert_from_hf

    assert convert_from_hf(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "imported"),
                            "--override", "seq_length=16", "--override", "make_vocab_size_divisible_by=32"]) == 0
    # The first iteration runs at lr 0 (start of the warmup), so the weights saved after it
    # must be exactly the imported ones, gathered back from tp=2 x dp=2 ZeRO-3 partitions.
    args = argv(dataset, "--pretrained-checkpoint", str(tmp_path / "imported"), "--save", str(tmp_path / "ckpt"),
                iters=1)
    run(4, args)
    _, trained, _ = load_full_model(str(tmp_path / "ckpt"))
    from safetensors.torch import load_file

    imported = load_file(str(tmp_path / "imported" / "model_full.safetensors"))
    assert trained.keys() == imported.keys()
    for k in imported:
        torch.testing.assert_close(trained[k], imported[k].float(), atol=0, rtol=0, msg=lambda m: f"{k}: {m}")


def test_nan_loss_stops_with_iteration_and_debug_checkpoint(dataset, tmp_path):
    with pytest.raises(AssertionError, match="non-finite loss at iteration 3"):
        run(4, argv(dataset, "--save", str(tmp_path)), nan_at_iteration=3)
    assert os.path.exists(tmp_path / "debug" / "iter_0000003" / "manifest.json")


def test_nan_loss_with_the_check_off_skips_the_step_and_trains_on(dataset, tmp_path):
    # Megatron's --no-check-for-nan-in-loss-and-grad: no stop and no debug copy; the engine skips the poisoned step
    result = run(1, argv(dataset, "--save", str(tmp_path), "--no-check-for-nan-in-loss-and-grad", tp=1, stage=1),
                 nan_at_iteration=3)
    assert result.iteration == 8 and not os.path.exists(tmp_path / "debug")
    assert math.isnan(result.losses[3]) and all(math.isfinite(result.losses[i]) for i in (1, 2, 4, 5, 6, 7, 8))


def _pretrain_gpt_main(args):
    """pretrain_gpt.py's main() on this rank of the pool (whose process group outlives the run);
    returns its exit status and what the engine it built was given and uses."""
    from unittest import mock

    import torch.distributed as dist

    import pretrain_gpt
    from megazero import zero

    seen, built, initialize, destroy = [], [], zero.initialize, dist.destroy_process_group

    def keep_world(group=None):  # main() ends by destroying the default group; the pool's must live on
        if group is not None:
            destroy(group)

    def probe(*a, **k):
        engine = initialize(*a, **k)
        z = engine.config.zero_optimization
        seen.append({"stage": engine.stage, "dp": engine.dp_size, "reduce_bucket_size": z.reduce_bucket_size,
                     "stage3_prefetch_bucket_size": z.stage3_prefetch_bucket_size,
                     "stage3_max_live_parameters": z.stage3_max_live_parameters,
                     "stage3_param_persistence_threshold": z.stage3_param_persistence_threshold,
                     "reducer.bucket_numel": engine.reducer.bucket_numel,
                     "window.prefetch_numel": engine.window.prefetch_numel,
                     "window.max_live_numel": engine.window.max_live_numel})
        built.append(engine)
        return engine

    with mock.patch.object(zero, "initialize", probe), mock.patch.object(dist, "destroy_process_group", keep_world):
        rc = pretrain_gpt.main(list(args))
    # gradient reduce-scatters (one per bucket) per backward: the bucket size at work
    return rc, seen, [e.comm.calls[("reduce_scatter", "dp")] / e.micro_steps for e in built]


def test_deepspeed_json_zero3_knobs_reach_the_engine_of_pretrain_gpt(dataset, tmp_path):
    """pretrain_gpt.py --deepspeed_config ds.json at dp 2, ZeRO-3: the JSON's bucket sizes reach the
    engine; they change when gathers and reductions happen, not the numbers."""
    # threshold 0: every layer is a unit of its own (the default 1e5 keeps this tiny model whole)
    knobs = {"reduce_bucket_size": 3000, "stage3_prefetch_bucket_size": 2000, "stage3_max_live_parameters": 20000,
             "stage3_param_persistence_threshold": 0}
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, **knobs}}))
    base = argv(dataset, tp=1, iters=2)
    base[base.index("--log-interval") + 1] = "1"
    runs = {}
    for name, extra in (("json", ["--deepspeed_config", str(ds)]), ("flags", [])):
        metrics = tmp_path / f"{name}.jsonl"
        out = run_distributed(2, _pretrain_gpt_main, base + extra + ["--metrics-file", str(metrics)])
        assert [rc for rc, _, _ in out] == [0, 0]
        losses = {m["iteration"]: m["lm_loss"] for m in map(json.loads, open(metrics)) if "lm_loss" in m}
        runs[name] = ([engines for _, engines, _ in out], losses, out[0][2][0])
    (engines, losses, buckets), (default_engines, reference, default_buckets) = runs["json"], runs["flags"]
    assert engines == [[{"stage": 3, "dp": 2, **knobs, "reducer.bucket_numel": 3000, "window.prefetch_numel": 2000,
                         "window.max_live_numel": 20000}]] * 2
    assert default_engines[0][0]["reduce_bucket_size"] is None  # the engine's default without the JSON: one unit per bucket
    assert default_engines[0][0]["stage3_prefetch_bucket_size"] is None  # the next unit
    assert buckets > 1 and default_buckets == 1, (buckets, default_buckets)  # 3000 elements: a bucket per layer
    assert sorted(losses) == sorted(reference) == [1, 2]
    for i in (1, 2):
        assert losses[i] == pytest.approx(reference[i], rel=1e-6), (i, losses, reference)
