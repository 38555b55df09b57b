"""LR schedule: Megatron's OptimizerParamScheduler values, exactly."""

import math

import pytest
import torch

from megazero.training import LRScheduler, parse_args


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
