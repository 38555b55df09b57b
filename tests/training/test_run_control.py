"""Run control with Megatron's semantics: SIGTERM save-and-exit resumes exactly, batch ramp-up,
--exit-duration-in-mins, --skip-train and the end-of-training evaluation."""

import os
import signal

import pytest
import torch

from megazero.config.train_config import ConfigError, rampup_global_batch_size
from megazero.training.loop import Callback
from tests.distributed import run_distributed
from tests.training.test_e2e import argv


def test_rampup_sequence_is_megatrons():
    # 16 -> 64 by 16 over 300 samples: 3 increments, one every 100 samples.
    seq, consumed = [], 0
    while consumed < 600:
        seq.append(rampup_global_batch_size((16, 16, 300), 64, consumed))
        consumed += seq[-1]
    # consumed 0..96 -> 16; 112, 144, 176 -> 32; 208, 256 -> 48; 304 (> 300) on -> 64
    assert seq == [16] * 7 + [32] * 3 + [48] * 2 + [64] * 5
    # the 175B example's ramp: 16 -> 1536 by 16 over 5,859,375 samples (61,677.6 samples per step)
    assert rampup_global_batch_size((16, 16, 5859375), 1536, 61677) == 16
    assert rampup_global_batch_size((16, 16, 5859375), 1536, 61678) == 32
    assert rampup_global_batch_size((16, 16, 5859375), 1536, 5859376) == 1536


class SigtermOneRank(Callback):
    """SIGTERM to rank 1 alone (a cluster may signal one rank only) before the ``at``-th step run here."""

    def __init__(self, at):
        self.at, self.calls = at, 0

    def on_step_start(self, state, batches):
        import torch.distributed as dist

        self.calls += 1
        if self.calls == self.at and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGTERM)


def _pretrain(args, world, sigterm_at=None):
    from megazero.config import parse_args
    from megazero.training.trainer import pretrain

    torch.manual_seed(0)
    r = pretrain(parse_args(args, world), callbacks=[SigtermOneRank(sigterm_at)])
    return r.losses, r.iteration, r.consumed_samples, r.exit_reason, r.final_eval


def test_sigterm_saves_exits_and_resumes_exactly(dataset, tmp_path):
    common = dict(tp=1, stage=2, iters=6)
    full, *_ = run_distributed(2, _pretrain, argv(dataset, **common), 2)[0]
    save = str(tmp_path / "ckpt")
    ckpt = ["--save", save, "--load", save, "--exit-signal-handler"]
    first, it, _, reason, _ = run_distributed(2, _pretrain, argv(dataset, *ckpt, **common), 2, sigterm_at=3)[0]
    assert it == 3 and "SIGTERM" in reason
    assert open(os.path.join(save, "latest")).read().strip() == "iter_0000003"
    rest, it, *_ = run_distributed(2, _pretrain, argv(dataset, *ckpt, **common), 2)[0]
    assert it == 6 and sorted(first) == [1, 2, 3] and sorted(rest) == [4, 5, 6]
    assert {**first, **rest} == full  # bit-exact


def test_rampup_run_and_exit_duration(dataset):  
    # micro 4 x dp 2 = 8 per micro-step; ramp 8 -> 16 by 8 over 16 samples (one increment after 16):
    # consumed 0, 8 -> 8; 16 (not yet > 16, but floor(16 / 16) = 1), 32, 48 -> 16
    args = argv(dataset, "--rampup-batch-size", "8", "8", "16", tp=1, stage=1, iters=5)
    losses, it, consumed, reason, final = run_distributed(2, _pretrain, args, 2)[0]
    assert it == 5 and consumed == 8 + 8 + 16 + 16 + 16 and reason is None
    assert all(torch.isfinite(torch.tensor(v)) for v in losses.values())
    assert set(final) == {"valid"}  # split 90,10,0: no test split
    args = argv(dataset, "--exit-duration-in-mins", "1e-9", tp=1, stage=1, iters=5)
    _, it, _, reason, _ = run_distributed(2, _pretrain, args, 2)[0]
    assert it == 1 and reason == "--exit-duration-in-mins 1e-09"


def test_skip_train_only_evaluates(dataset):  
    args = argv(dataset, "--skip-train", "--split", "80,10,10", tp=1, stage=1, iters=5)
    losses, it, _, _, final = run_distributed(2, _pretrain, args, 2)[0]
    assert losses == {} and it == 0 and set(final) == {"valid", "test"}


def test_resume_in_the_middle_of_a_ramp_is_exact(dataset, tmp_path):
    ramp = ["--rampup-batch-size", "8", "8", "24"]  # batches 8, 8, 8, 16 (24 not > 24 but floor(24/24)=1), 16, 16
    common = dict(tp=1, stage=2, iters=6)
    full, _, consumed_full, *_ = run_distributed(2, _pretrain, argv(dataset, *ramp, **common), 2)[0]
    save = str(tmp_path / "ckpt")
    ckpt = [*ramp, "--save", save, "--load", save]
    first, it, consumed, *_ = run_distributed(2, _pretrain, argv(dataset, *ckpt, "--exit-interval", "2", **common),
                                              2)[0]
    assert it == 2 and consumed == 16  # stopped with the batch still ramping
    rest, it, consumed, *_ = run_distributed(2, _pretrain, argv(dataset, *ckpt, **common), 2)[0]
    assert it == 6 and consumed == consumed_full == 8 + 8 + 8 + 16 + 16 + 16
    assert {**first, **rest} == full


def test_finetune_and_no_load_optim(dataset, tmp_path):
    save = str(tmp_path / "ckpt")
    common = dict(tp=1, stage=1, iters=4)
    run_distributed(2, _pretrain, argv(dataset, "--save", save, "--exit-interval", "2", **common), 2)
    resumed, *_ = run_distributed(2, _pretrain, argv(dataset, "--load", save, **common), 2)[0]
    fresh_optim, it, *_ = run_distributed(2, _pretrain, argv(dataset, "--load", save, "--no-load-optim", **common),
                                          2)[0]
    assert it == 4 and fresh_optim[3] == resumed[3]  # same weights, same first batch
    assert fresh_optim[4] != resumed[4]  # the Adam moments started afresh
    tuned, it, consumed, *_ = run_distributed(2, _pretrain, argv(dataset, "--load", save, "--finetune", **common),
                                              2)[0]
    scratch, *_ = run_distributed(2, _pretrain, argv(dataset, **common), 2)[0]
    assert it == 4 and sorted(tuned) == [1, 2, 3, 4] and consumed == 4 * 16  # counters start afresh
    assert tuned[1] < scratch[1]  # the same first batch, from the trained weights


def test_train_tokens_stops_the_run(dataset):  
    args = argv(dataset, tp=1, stage=1, iters=8)
    for flag in ("--train-iters", "--lr-warmup-iters"):
        i = args.index(flag)
        del args[i:i + 2]
    # 16 samples x 16 tokens = 256 tokens per iteration: 600 tokens stop after 3 iterations
    args += ["--train-samples", "128", "--train-tokens", "600", "--lr-warmup-tokens", "256",
             "--lr-decay-tokens", "2048"]
    _, it, consumed, reason, _ = run_distributed(2, _pretrain, args, 2)[0]
    assert it == 3 and consumed == 48 and reason == "--train-tokens 600 reached"


def test_no_load_rng_and_use_checkpoint_args(dataset, tmp_path):
    from megazero.config import parse_args

    save = str(tmp_path / "ckpt")
    common = dict(tp=1, stage=1, iters=3, dropout=0.1)
    run_distributed(2, _pretrain, argv(dataset, "--save", save, "--exit-interval", "2", **common), 2)
    resumed, *_ = run_distributed(2, _pretrain, argv(dataset, "--load", save, **common), 2)[0]
    fresh_rng, *_ = run_distributed(2, _pretrain, argv(dataset, "--load", save, "--no-load-rng", **common), 2)[0]
    assert fresh_rng[3] != resumed[3]  # other dropout masks: the saved RNG streams were not loaded
    # --use-checkpoint-args: the checkpoint's shape and architecture are used; a model flag that agrees
    # with it is accepted, one that disagrees refused with both values
    args = argv(dataset, "--load", save, "--use-checkpoint-args", "--normalization", "layernorm", tp=1, stage=1)
    for flag in ("--num-layers", "--hidden-size"):
        i = args.index(flag)
        del args[i:i + 2]
    m = parse_args(args, 2).model
    assert (m.num_layers, m.hidden_size, m.activation, m.normalization) == (2, 32, "gelu", "layernorm")
    with pytest.raises(ConfigError, match="--swiglu disagrees with the checkpoint"):
        parse_args(args + ["--swiglu"], 2)
    heads = args[args.index("--num-attention-heads") + 1]
    args[args.index("--num-attention-heads") + 1] = "8"
    with pytest.raises(ConfigError, match=f"--num-attention-heads 8 disagrees with the checkpoint's "
                                          f"(num_attention_heads=|--num-attention-heads ){heads}"):
        parse_args(args, 2)
