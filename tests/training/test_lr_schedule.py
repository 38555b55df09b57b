"""LR schedule: Megatron's OptimizerParamScheduler values, exactly."""

import math

import pytest
import torch

from megazero.config import parse_args
from megazero.training import LRScheduler


def sched(style, **kw):
    args = dict(max_lr=1.0, min_lr=0.1, warmup_steps=10, decay_steps=110, decay_style=style)
    args.update(kw)
    return LRScheduler(**args)


def test_linear_warmup_from_zero():
    s = sched("cosine")
    assert [s.get_lr(n) for n in (0, 1, 5, 10)] == [0.0, 0.1, 0.5, 1.0]


@pytest.mark.parametrize("style, expected", [
    # t = (n - 10) / 100 at n = 10, 35, 60, 85, 110
    ("linear", [1.0, 0.775, 0.55, 0.325, 0.1]),
    ("cosine", [1.0, 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), 0.55,
                0.1 + 0.9 * 0.5 * (1 + math.cos(3 * math.pi / 4)), 0.1]),
    ("constant", [1.0, 1.0, 1.0, 1.0, 1.0]),
])
def test_decay_styles(style, expected):
    s = sched(style)
    got = [s.get_lr(n) for n in (10, 35, 60, 85, 110)]
    assert got == pytest.approx(expected, abs=1e-15)


def test_min_lr_after_decay_end_and_constant_keeps_max():
    assert sched("cosine").get_lr(111) == 0.1 and sched("linear").get_lr(10 ** 9) == 0.1
    assert sched("constant").get_lr(10 ** 9) == 1.0


def test_no_warmup_starts_at_max():
    s = sched("linear", warmup_steps=0, decay_steps=100)
    assert s.get_lr(0) == 1.0 and s.get_lr(50) == pytest.approx(0.55)


def test_step_drives_optimizer_with_lr_mult():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([{"params": [p]}, {"params": [], "lr_mult": 0.5}], lr=123.0)
    s = sched("linear", optimizer=opt)
    assert opt.param_groups[0]["lr"] == 0.0  # step 0 of the warmup, as Megatron
    assert s.step(5) == 0.5
    assert opt.param_groups[0]["lr"] == 0.5 and opt.param_groups[1]["lr"] == 0.25


def test_samples_schedule_from_config():
    cfg = parse_args("--model-preset gpt-tiny --micro-batch-size 2 --global-batch-size 16 --train-iters 10 --lr 1e-3 "
                     "--min-lr 1e-4 --lr-warmup-iters 2 --lr-decay-style linear --mock-data".split(), 4)
    s = LRScheduler.from_config(cfg)
    assert (s.warmup_steps, s.decay_steps, s.decay_style) == (32, 160, "linear")
    lrs = [s.get_lr()] + [s.step(cfg.schedule.global_batch_size) for _ in range(10)]
    # iterations 0..10: warmup over 2 iterations, then linear to min at iteration 10
    expected = [0.0, 5e-4, 1e-3] + [1e-4 + 9e-4 * (1 - (i - 2) / 8) for i in range(3, 11)]
    assert lrs == pytest.approx(expected, rel=1e-12)


def test_resume_is_exact():
    a = sched("cosine")
    for _ in range(37):
        a.step(1)
    state = a.state_dict()
    b = sched("cosine")
    b.load_state_dict(state)
    assert b.num_steps == 37
    assert [a.step(3) for _ in range(10)] == [b.step(3) for _ in range(10)]


def test_resume_refuses_a_changed_schedule_unless_asked():
    state = sched("cosine", num_steps=20).state_dict()
    b = sched("linear")
    with pytest.raises(ValueError, match=r"decay_style differs from the checkpoint: current 'linear', checkpoint 'cosine'"):
        b.load_state_dict(state)
    b.load_state_dict(state, use_checkpoint_values=True)
    assert b.decay_style == "cosine" and b.num_steps == 20 and b.lr == sched("cosine").get_lr(20)


@pytest.mark.parametrize("kw, pattern", [
    (dict(decay_style="step"), "decay_style must be one of"),
    (dict(min_lr=2.0), "min_lr <= max_lr"),
    (dict(warmup_steps=200), r"warmup_steps \(200\) exceeds decay_steps \(110\)"),
    (dict(decay_steps=0, warmup_steps=0), "decay_steps >= 1"),
])
def test_invalid(kw, pattern):
    with pytest.raises(ValueError, match=pattern):
        sched(kw.pop("decay_style", "linear"), **kw)


# ---- Megatron's newer styles, against values worked out by hand ---------------------------------

def test_warmup_init_starts_warmup_there():
    s = LRScheduler(max_lr=1.0, min_lr=0.0, warmup_steps=4, decay_steps=8, decay_style="linear", init_lr=0.2)
    assert [s.get_lr(n) for n in (0, 2, 4)] == pytest.approx([0.2, 0.6, 1.0], abs=1e-15)


def test_inverse_square_root():
    s = LRScheduler(max_lr=1.0, min_lr=0.1, warmup_steps=4, decay_steps=400, decay_style="inverse-square-root")
    assert s.get_lr(4) == 1.0 and s.get_lr(16) == 0.5 and s.get_lr(64) == 0.25
    assert s.get_lr(399) == pytest.approx(0.1001252, abs=1e-7)  # 2 / sqrt(399)
    assert s.get_lr(401) == 0.1  # past the decay end: min_lr, as Megatron checks that first


@pytest.mark.parametrize("style, expected", [
    # warmup 2, decay end 10, anneal over the last 4 (from step 6): r = 0.25, 0.5, 1 at steps 7, 8, 10
    ("linear", [1.0, 1.0, 0.75, 0.5, 0.0]),
    ("cosine", [1.0, 1.0, 0.5 * (1 + math.cos(math.pi / 4)), 0.5, 0.0]),
    ("exponential", [1.0, 1.0, 2 * 0.5 ** 0.25 - 1, 2 * 0.5 ** 0.5 - 1, 0.0]),
    ("minus_sqrt", [1.0, 1.0, 0.5, 1 - math.sqrt(0.5), 0.0]),
])
def test_wsd(style, expected):
    s = LRScheduler(max_lr=1.0, min_lr=0.0, warmup_steps=2, decay_steps=10, decay_style="WSD",
                    wsd_decay_steps=4, wsd_decay_style=style)
    assert [s.get_lr(n) for n in (3, 6, 7, 8, 10)] == pytest.approx(expected, abs=1e-12)
    assert s.get_lr(1) == 0.5 and s.get_lr(11) == 0.0


@pytest.mark.parametrize("style, mid", [("linear", 0.055), ("cosine", 0.055), ("constant", None)])
def test_weight_decay_schedule_sets_only_decayed_groups(style, mid):
    w, b = torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([{"params": [w], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}], lr=1.0)
    start, end = (0.01, 0.1) if style != "constant" else (0.1, 0.1)
    s = LRScheduler(max_lr=1.0, decay_steps=100, start_wd=start, end_wd=end, wd_incr_steps=100, wd_incr_style=style,
                    optimizer=opt)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(start) and opt.param_groups[1]["weight_decay"] == 0.0
    s.step(50)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(mid if mid else 0.1)
    s.step(25)  # 3/4 of the way: linear 0.0775; cosine 0.01 + 0.09 * 0.5 * (1 + cos(pi/4))
    expected = {"linear": 0.0775, "cosine": 0.01 + 0.09 * 0.5 * (1 + math.cos(math.pi / 4)), "constant": 0.1}[style]
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(expected, abs=1e-12)
    s.step(100)
    assert opt.param_groups[0]["weight_decay"] == pytest.approx(end) and opt.param_groups[1]["weight_decay"] == 0.0


def test_resume_override_and_use_checkpoint():
    a = LRScheduler(max_lr=1.0, warmup_steps=2, decay_steps=10, num_steps=5)
    b = LRScheduler(max_lr=2.0, warmup_steps=2, decay_steps=10)
    with pytest.raises(ValueError, match="max_lr differs .* --override-opt_param-scheduler"):
        b.load_state_dict(a.state_dict())
    b.load_state_dict(a.state_dict(), override=True)
    assert b.max_lr == 2.0 and b.num_steps == 5
    b.load_state_dict(a.state_dict(), use_checkpoint_values=True)
    assert b.max_lr == 1.0 and b.get_lr() == a.get_lr()


def test_token_schedule_from_config_counts_tokens():
    base = ("--model-preset gpt-tiny --micro-batch-size 2 --lr 1.0 --min-lr 0 --mock-data --lr-decay-style linear "
            "--train-samples 64 --lr-warmup-tokens 256 --lr-decay-tokens 2048").split()
    cfg = parse_args(base, 4)  # seq 64, global batch 8: one iteration = 512 tokens
    s = LRScheduler.from_config(cfg)
    assert LRScheduler.increment(cfg, 8) == 512
    lrs = [s.step(LRScheduler.increment(cfg, 8)) for _ in range(4)]
    # tokens 512, 1024, 1536, 2048: past the 256-token warmup, linear to 0 at 2048
    assert lrs == pytest.approx([1 - (512 - 256) / 1792, 1 - (1024 - 256) / 1792, 1 - (1536 - 256) / 1792, 0.0])
