"""pretrain_gpt.py with --pp > 1: training through the pipeline, evaluation, checkpoints at any layout.

Pipeline stages initialize their own layers (as in Megatron), so a pp = 2 run from scratch
is not the pp = 1 run; from one checkpoint, however, every layout must continue with the
same losses: the source is saved at pp 2 x tp 2, then resumed at pp 2 x tp 2 (exact), at
pp 1, at pp 4 x tp 1, interleaved, and at 8 ranks tp 2 x pp 2 x dp 2 with ZeRO-3.
"""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.distributed import run_distributed
from tests.launch import ROOT
from tests.training.test_e2e import argv


def _pretrain(args, world):
    from megazero.config import parse_args
    from megazero.training.trainer import pretrain

    torch.manual_seed(0)
    r = pretrain(parse_args(args, world))
    return r.losses, r.eval_losses, r.iteration, r.final_eval


def run(world, args):
    results = run_distributed(world, _pretrain, args, world)
    for other in results[1:]:  # the loss is broadcast from the last stage: every rank logs the same
        assert other[0] == results[0][0]
    return results[0]


def pp_argv(prefix, *extra, tp=2, pp=2, stage=1, iters=6, layers=4):
    args = argv(prefix, "--pp", str(pp), *extra, tp=tp, stage=stage, iters=iters)
    args[args.index("--num-layers") + 1] = str(layers)
    return args


def test_loss_falls_pp2_tp1(dataset):
    losses, evals, it, final = run(4, pp_argv(dataset, tp=1, iters=30, stage=2))
    assert it == 30
    first, last = np.mean([losses[i] for i in (1, 2, 3)]), np.mean([losses[i] for i in (28, 29, 30)])
    assert last < first - 1.0, (first, last)
    assert evals[28] < evals[4] and set(final) == {"valid"}


@pytest.fixture(scope="module")
def source(dataset, tmp_path_factory):
    """pp 2 x tp 2 ZeRO-1: 6 iterations uninterrupted, and 4 iterations saved."""
    d = tmp_path_factory.mktemp("pp_ckpt")
    full, _, _, _ = run(4, pp_argv(dataset, iters=6))
    run(4, pp_argv(dataset, "--save", str(d / "src"), "--exit-interval", "4", iters=6))
    return d / "src", full


def _continue(world, args, full):
    losses, _, it, _ = run(world, args)
    assert it == 6 and sorted(losses) == [5, 6]
    diff = max(abs(losses[i] - full[i]) for i in (5, 6))
    print(f"max loss difference at iterations 5, 6: {diff:.2e}")
    return diff


def test_pp2_resume_is_exact(dataset, source):
    src, full = source
    assert _continue(4, pp_argv(dataset, "--load", str(src)), full) < 1e-6


@pytest.mark.parametrize("world, extra, layout", [
    (4, [], dict(tp=2, pp=1, stage=3)),  # pp 2 -> pp 1, ZeRO-1 -> ZeRO-3
    (4, [], dict(tp=1, pp=4, stage=2)),  # pp 2 x tp 2 -> pp 4 x tp 1
    (4, ["--virtual-pipeline-model-parallel-size", "2"], dict(tp=1, pp=2, stage=3)),  # interleaved, ZeRO-3 x PP
    (8, [], dict(tp=2, pp=2, stage=3)),  # tp 2 x pp 2 x dp 2, ZeRO-3
])
def test_reshard_continues_with_the_same_losses(dataset, source, world, extra, layout):
    src, full = source
    assert _continue(world, pp_argv(dataset, "--load", str(src), *extra, **layout), full) < 1e-5


def test_pipeline_checkpoint_has_pp1_names_and_exports(dataset, source, tmp_path):
    from megazero.model import GPTModel
    from megazero.mpu import NO_GROUP
    from megazero.checkpoint.native import load_full_model

    src, _ = source
    cfg, weights, _ = load_full_model(str(src))
    model = GPTModel(cfg, tp_group=NO_GROUP)
    model.load_state_dict(weights, strict=True)  # every pp = 1 name, each once
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "hf"
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "convert_to_hf.py"), "--input", str(src),
                           "--output", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.randint(0, 100, (2, 12))
    with torch.no_grad():
        ours = model(ids)[..., :cfg.vocab_size]
        theirs = hf(ids).logits[..., :cfg.vocab_size]
    assert torch.allclose(ours, theirs, atol=1e-4), (ours - theirs).abs().max()


def test_generate_reads_a_pipeline_checkpoint_at_any_tp(source):
    from megazero.model import GPTModel
    from megazero.mpu import NO_GROUP
    from megazero.checkpoint.native import load_full_model
    from tests.training.test_tools_scale import _generate_losses

    src, _ = source
    cfg, weights, _ = load_full_model(str(src))
    model = GPTModel(cfg, tp_group=NO_GROUP)
    model.load_state_dict(weights, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids[:, :-1], labels=ids[:, 1:])
    for tp in (1, 2):  # tools/generate.py's loader: each TP rank reads its shard of every stage's file
        for loss, _, _ in run_distributed(tp, _generate_losses, str(src), tp):
            torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
