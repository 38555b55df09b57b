"""The engine's optimizer kernel choice and its step count across save/resume, on CPU.

apex is faked: ``apex.optimizers.FusedAdam`` is a small AdamW that counts steps in
``param_group["step"]`` as apex's does, or one whose constructor raises RuntimeError as
an apex built without its CUDA extensions does. The CUDA kernel choice is exercised by
passing ``device=cuda`` to :func:`build_optimizer` over CPU tensors (nothing touches a GPU).
"""

import logging
import sys
import types

import pytest
import torch

from megazero import zero
from megazero.model import GPTModel
from megazero.zero import optim as zoptim
from megazero.zero.checkpoint import load_zero_state, save_zero_state
from megazero.zero.config import OptimizerConfig
from megazero.zero.optim import build_optimizer, keeps_step_in_group, optimizer_step, say_once, set_optimizer_step
from tests.zero.common import BETAS, EPS, LR, SEED, WD, batches, ds_config, tiny_config

ROWS = 4
CUDA = torch.device("cuda")


class FakeFusedAdam(torch.optim.Optimizer):
    """apex's FusedAdam in miniature: AdamW math, the step count in ``param_group['step']``."""

    constructed = 0

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, adam_w_mode=True):
        type(self).constructed += 1
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                      adam_w_mode=adam_w_mode, bias_correction=True))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group["step"] + 1 if "step" in group else 1  # as apex: no state["step"]
            t, (b1, b2), lr = group["step"], group["betas"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"], state["exp_avg_sq"] = torch.zeros_like(p), torch.zeros_like(p)
                m, v = state["exp_avg"], state["exp_avg_sq"]
                p.mul_(1 - lr * group["weight_decay"])
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                p.addcdiv_(m, (v / (1 - b2 ** t)).sqrt_().add_(group["eps"]), value=-lr / (1 - b1 ** t))


FakeFusedAdam.__module__ = "apex.optimizers.fused_adam"  # where apex's class lives


class BrokenFusedAdam(FakeFusedAdam):
    """apex installed without its CUDA extensions: importable, fails when constructed."""

    def __init__(self, params, **kw):
        super().__init__(params, **kw)
        raise RuntimeError("apex.optimizers.FusedAdam requires cuda extensions")


def _install_apex(monkeypatch, cls):
    apex, optimizers = types.ModuleType("apex"), types.ModuleType("apex.optimizers")
    optimizers.FusedAdam = cls
    apex.optimizers = optimizers
    monkeypatch.setitem(sys.modules, "apex", apex)
    monkeypatch.setitem(sys.modules, "apex.optimizers", optimizers)
    zoptim.say_once.cache_clear()  # every test may say its choice again
    FakeFusedAdam.constructed = 0


def _groups():
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(3))
    return [{"params": [a], "weight_decay": 0.1}, {"params": [b], "weight_decay": 0.0}]


def test_cuda_uses_apex_fused_adam_when_it_works(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="megazero.zero.optim")
    say_once.cache_clear()
    _install_apex(monkeypatch, FakeFusedAdam)
    opt = build_optimizer(_groups(), OptimizerConfig(), CUDA)
    assert isinstance(opt, FakeFusedAdam) and keeps_step_in_group(opt)
    assert "apex FusedAdam" in caplog.text


@pytest.mark.parametrize("apex", ["broken", "absent"])
def test_cuda_falls_back_to_torch_on_any_apex_failure(monkeypatch, caplog, apex):
    caplog.set_level(logging.INFO, logger="megazero.zero.optim")
    say_once.cache_clear()
    if apex == "broken":
        _install_apex(monkeypatch, BrokenFusedAdam)
    else:
        _install_apex(monkeypatch, FakeFusedAdam)
        monkeypatch.setitem(sys.modules, "apex", None)  # `import apex...` raises ImportError
        monkeypatch.setitem(sys.modules, "apex.optimizers", None)
    groups = _groups()
    opt = build_optimizer(groups, OptimizerConfig(), CUDA)
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert "adam_w_mode" not in opt.param_groups[0]  # apex's half-built groups did not leak in
    build_optimizer(_groups(), OptimizerConfig(), CUDA)
    err = caplog.text
    assert err.count("torch AdamW(fused=True)") == 1  # said once per process
    assert ("RuntimeError" if apex == "broken" else "ModuleNotFoundError") in err
    assert not keeps_step_in_group(opt)


def test_cpu_never_tries_apex(monkeypatch):
    _install_apex(monkeypatch, FakeFusedAdam)
    opt = build_optimizer(_groups(), OptimizerConfig(), torch.device("cpu"))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"] and FakeFusedAdam.constructed == 0
    assert type(build_optimizer(_groups(), OptimizerConfig(adam_w_mode=False), "cpu")) is torch.optim.Adam


def test_step_count_is_read_and_written_where_the_kernel_keeps_it(monkeypatch):
    _install_apex(monkeypatch, FakeFusedAdam)
    for device in (CUDA, torch.device("cpu")):  # apex (group) and torch (state)
        groups = _groups()
        opt = build_optimizer(groups, OptimizerConfig(), device)
        for _ in range(3):
            for g in groups:
                g["params"][0].grad = torch.ones_like(g["params"][0])
            opt.step()
        assert optimizer_step(opt) == 3
        set_optimizer_step(opt, 7)
        assert optimizer_step(opt) == 7
        state_steps = [int(s["step"]) for s in opt.state.values() if "step" in s]
        group_steps = [g["step"] for g in opt.param_groups if "step" in g]
        assert (group_steps, state_steps) == (([7, 7], []) if device == CUDA else ([], [7, 7]))


# ---------------------------------------------------------------- save / resume through the engine


def _engine(cuda_kernel: bool, seed: int = SEED):
    torch.manual_seed(seed)
    engine = zero.initialize(GPTModel(tiny_config()), ds_config(1, micro=ROWS))
    if cuda_kernel:  # the optimizer a CUDA run builds, over these (CPU) masters
        groups = [{"params": g["params"], "weight_decay": g["weight_decay"]} for g in engine.optimizer.param_groups]
        engine.optimizer = build_optimizer(groups, engine.config.optimizer, CUDA)
    return engine


def _train(engine, data, steps):
    for step in steps:
        rows = data[step, 0]
        engine.backward(engine(rows[:, :-1], labels=rows[:, 1:]).mean())
        engine.step()
    return engine.consolidated_state_dict()


@pytest.mark.parametrize("saver,loader", [("apex", "apex"), ("apex", "torch"), ("torch", "apex")])
def test_resume_continues_the_step_count(monkeypatch, tmp_path, saver, loader):
    """N steps, save, resume in a fresh engine, M steps == N + M uninterrupted steps (same kernel
    when saver == loader), and the resumed kernel counts from N whichever kernel saved."""
    _install_apex(monkeypatch, FakeFusedAdam)
    n, m = 3, 2
    data = batches(n + m, 1, ROWS)
    engine = _engine(saver == "apex")
    _train(engine, data, range(n))
    save_zero_state(engine, str(tmp_path))
    expected = _train(engine, data, range(n, n + m))

    resumed = _engine(loader == "apex", seed=SEED + 1)  # different init: all must come from the checkpoint
    load_zero_state(resumed, str(tmp_path))
    assert isinstance(resumed.optimizer, FakeFusedAdam) == (loader == "apex")
    assert optimizer_step(resumed.optimizer) == n
    if loader == "apex":
        assert [g["step"] for g in resumed.optimizer.param_groups] == [n] * len(resumed.optimizer.param_groups)
    got = _train(resumed, data, range(n, n + m))
    if saver == loader:
        for k in expected:
            torch.testing.assert_close(got[k], expected[k], atol=1e-6, rtol=1e-6, msg=lambda s: f"{k}: {s}")


@pytest.mark.parametrize("stage", [0, 3])
def test_fp32_default_steps_bit_identically_to_torch_fused_adamw(stage):
    """The fp32 default on CPU is torch's fused AdamW over flat master partitions: elementwise, so
    at dp = 1 (nothing summed in another order) the engine's weights equal, bit for bit, those of
    one process stepping the same model with ``torch.optim.AdamW(fused=True)``. The default
    CPU kernel (for-loop) would differ by ~1e-7 per step: this pins the kernel, not a tolerance."""
    steps, data = 4, batches(4, 1, ROWS)
    torch.manual_seed(SEED)
    ref = GPTModel(tiny_config())
    opt = torch.optim.AdamW(ref.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)  # ds_config's
    torch.manual_seed(SEED)
    engine = zero.initialize(GPTModel(tiny_config()), ds_config(stage, micro=ROWS))
    assert type(engine.optimizer) is torch.optim.AdamW and engine.optimizer.defaults["fused"]
    for step in range(steps):
        rows = data[step, 0]
        ref_loss = ref(rows[:, :-1], labels=rows[:, 1:]).mean()
        opt.zero_grad()
        ref_loss.backward()
        opt.step()
        loss = engine(rows[:, :-1], labels=rows[:, 1:]).mean()
        engine.backward(loss)
        assert engine.step()
        assert torch.equal(loss.detach(), ref_loss.detach()), f"step {step}: {loss.item()} vs {ref_loss.item()}"
    weights = engine.consolidated_state_dict()
    for name, value in ref.state_dict().items():
        assert torch.equal(weights[name], value), f"{name}: max |diff| {(weights[name] - value).abs().max()}"
