"""Muon through zero.initialize (DeepSpeed's JSON): every ZeRO stage at tp 2 x dp 2, with gradient
accumulation and clipping, equals one process of torch.optim.Muon (the 2-D weights inside the layers)
plus torch.optim.AdamW (the rest); Newton-Schulz runs once per matrix per step."""

import dataclasses

import pytest
import torch

from megazero.model import GPTModel
from megazero.zero.config import ZeroConfigError, load_config
from megazero.zero.optimizers import MuonConfig
from megazero.zero.optimizers.muon_step import newton_schulz
from tests.distributed import run_distributed
from tests.zero.common import (GLOBAL_MICRO_ROWS, SEED, WD, batches, ds_config, reference_run, tiny_config,
                               zero_run)

MUON_LR, ADAM_LR, STEPS, ACCUM, CLIP = 0.02, 3e-3, 4, 2, 0.5
MUON = {"optimizer": {"type": "Muon", "params": {"lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": 0.9,
                                                 "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": WD}}}


def takes_muon(name: str, p: torch.Tensor) -> bool:
    return p.dim() == 2 and name.startswith("layers.")


def _fp32_muon_step(params, momentum, lr, wd):
    """torch.optim.Muon's update with Newton-Schulz in fp32 (what the fp32 engine runs)."""
    for p, buf in zip(params, momentum):
        buf.lerp_(p.grad, 1 - 0.9)
        update = newton_schulz(p.grad.lerp(buf, 0.9), (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
        p.mul_(1 - lr * wd)
        p.add_(update, alpha=-lr * max(1, p.shape[0] / p.shape[1]) ** 0.5)


def reference(fp32: bool, clip: float = CLIP, fused: bool = False, accum: int = ACCUM):
    """One process: torch.optim.Muon (or its fp32 twin) on the layers' matrices, AdamW on the rest."""
    counts = []

    def make_step(model):
        named = list(model.named_parameters())
        matrices = [p for n, p in named if takes_muon(n, p)]
        counts.append(len(matrices))
        muon = torch.optim.Muon(matrices, lr=MUON_LR, momentum=0.9, weight_decay=WD)
        adam = torch.optim.AdamW([p for n, p in named if not takes_muon(n, p)], lr=ADAM_LR, betas=(0.9, 0.95),
                                 eps=1e-8, weight_decay=WD, fused=fused)
        momentum = [torch.zeros_like(p) for p in matrices]

        @torch.no_grad()
        def step():
            _fp32_muon_step(matrices, momentum, MUON_LR, WD) if fp32 else muon.step()
            adam.step()
        return step

    losses, _, weights = reference_run(STEPS, accum, clip, make_step=make_step)
    return losses, weights, counts[0]


def _run(stage, fp32):
    import torch.distributed as dist

    extra = dict(MUON)
    if fp32:
        cfg = load_config(ds_config(stage, ACCUM, CLIP, 0, GLOBAL_MICRO_ROWS // 2, **MUON))
        cfg = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, settings=MuonConfig(ns_dtype="fp32")))
        extra = None
    losses, _, weights, runs = zero_run(2, stage, steps=STEPS, accum=ACCUM, clip=CLIP, extra=extra,
                                        after=lambda e: e.matrix_step.ns_runs, config=cfg if fp32 else None)
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, runs)
    return losses, weights if dist.get_rank() == 0 else None, counts


@pytest.mark.parametrize("stage,fp32", [(0, False), (1, True), (2, True), (3, True), (3, False)])
def test_muon_equals_one_process_at_tp2_dp2(stage, fp32):
    ref_losses, ref_weights, matrices = reference(fp32)
    results = run_distributed(4, _run, stage, fp32)
    losses, weights, counts = results[0]
    # bf16 Newton-Schulz rounds an input that differs from one process's by fp32 noise, and the
    # iteration amplifies it (one process equals torch.optim.Muon bit for bit: the test below)
    tol, loss_tol = (1e-5, 1e-5) if fp32 else (3e-3, 1e-4)
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < loss_tol, (losses, ref_losses)
    diff = max(float((weights[k].float() - v).abs().max()) for k, v in ref_weights.items())
    assert diff < tol, diff
    moved = max(float((ref_weights[k] - v).abs().max()) for k, v in _initial().items() if "linear_fc1.weight" in k)
    assert moved > 10 * tol, moved  # the steps moved the matrices well beyond the tolerance
    # each TP rank's dp group runs every matrix once per optimizer step (not per micro-batch);
    # ranks 0, 2 are TP rank 0 (tp 2 x dp 2: tp groups {0, 1}, {2, 3})
    assert counts[0] + counts[2] == STEPS * matrices and counts[1] + counts[3] == STEPS * matrices, counts
    assert min(counts) > 0  # the owners are spread over the data-parallel ranks


def _initial():
    torch.manual_seed(SEED)
    return {k: v.detach().clone() for k, v in GPTModel(tiny_config()).state_dict().items()}


@pytest.mark.parametrize("accum", [1, 2])
def test_one_process_equals_torch_muon_bit_for_bit(accum):
    """ZeRO-1 on one rank, without clipping (torch's norm is fp32, the engine's fp64): the weights are
    torch.optim.Muon's and torch's fused AdamW's, to the bit, with or without gradient accumulation."""
    import megazero.zero as zero

    torch.manual_seed(SEED)
    model = GPTModel(tiny_config())
    engine = zero.initialize(model, ds_config(1, accum, 0.0, 0, GLOBAL_MICRO_ROWS, **MUON))
    _, ref_weights, matrices = reference(False, clip=0.0, fused=True, accum=accum)
    data = batches(STEPS, accum, GLOBAL_MICRO_ROWS)
    for step in range(STEPS):
        for a in range(accum):
            rows = data[step, a]
            engine.backward(engine(rows[:, :-1], labels=rows[:, 1:]).mean())
            engine.step()
    weights = model.state_dict()
    assert [k for k, v in ref_weights.items() if not torch.equal(weights[k], v)] == []
    assert engine.matrix_step.ns_runs == STEPS * matrices


def test_newton_schulz_is_torch_muons():
    """bf16: torch.optim.Muon's own iteration, bit for bit (wide and tall); fp32: the same map."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.Generator().manual_seed(3)
    for shape in ((24, 40), (40, 24)):
        u = torch.randn(shape, generator=g)
        ref = _zeropower_via_newtonschulz(u, (3.4445, -4.7750, 2.0315), 5, 1e-7)
        assert torch.equal(newton_schulz(u, (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.bfloat16), ref)
        fp32 = newton_schulz(u, (3.4445, -4.7750, 2.0315), 5, 1e-7, torch.float32)
        assert float((fp32 - ref.float()).abs().max()) < 0.05 and fp32.dtype == torch.float32


def test_muon_json_refusals():
    with pytest.raises(ZeroConfigError, match="unknown key optimizer.params.amsgrad.*Muon takes"):
        load_config({"optimizer": {"type": "Muon", "params": {"amsgrad": True}}})
    with pytest.raises(ZeroConfigError, match="offload_optimizer.*Muon"):
        load_config({"optimizer": {"type": "Muon"}, "zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ZeroConfigError, match="momentum"):
        load_config({"optimizer": {"type": "Muon", "params": {"momentum": 1.5}}})
    cfg = load_config({"optimizer": {"type": "muon", "params": {"lr": 0.02, "muon_lr": 0.05, "adam_lr": 1e-3}}})
    assert cfg.optimizer.type == "Muon" and cfg.optimizer.muon_lr == 0.05 and cfg.optimizer.adam_lr == 1e-3


def test_use_muon_on_a_vector_is_refused():
    import megazero.zero as zero

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model[0].bias.use_muon = True
    with pytest.raises(ZeroConfigError, match=r"0.bias is tagged use_muon but has shape \(4,\)"):
        zero.initialize(model, {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon"}})


def test_use_muon_tags_choose_the_matrices():
    import megazero.zero as zero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Linear(6, 2))
    model[1].weight.use_muon = False  # a head: the auxiliary AdamW
    model[0].weight.use_muon = True  # outside any layer list, tagged in
    engine = zero.initialize(model, {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Muon"}})
    assert [s.name for g in engine.groups if g.per_matrix for s in g.slots] == ["0.weight"]


def test_a_skipped_fp16_step_leaves_the_momentum_alone():
    """An inf gradient (a loss scale too large for fp16) skips the step before the optimizer: no
    momentum is created or changed, the weights stay; the next steps update with finite state."""
    import megazero.zero as zero

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ModuleList([torch.nn.Linear(16, 16)]))
    layer = model[1][0]
    layer.weight.use_muon = True
    engine = zero.initialize(model, {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Muon"},
                                     "fp16": {"enabled": True, "initial_scale_power": 30, "hysteresis": 1}})
    before = layer.weight.detach().clone()
    x = torch.randn(2, 8).half()

    def step():
        engine.backward(layer(model[0](x)).float().pow(2).mean())
        return engine.step()

    assert not step() and engine.skipped_steps == 1
    master = next(g.master for g in engine.groups if g.per_matrix)
    assert "momentum_buffer" not in engine.optimizer.state.get(master, {})
    assert torch.equal(layer.weight, before)
    while not step():
        assert engine.skipped_steps < 40
    buf = engine.optimizer.state[master]["momentum_buffer"]
    assert torch.isfinite(buf).all() and buf.abs().max() > 0 and not torch.equal(layer.weight, before)


def test_parameter_offload_steps_muon_alike():
    """ZeRO-3 with the parameter partitions on the host: the same weights as without (Muon's masters stay
    on the device; its optimizer offload is refused above)."""
    import megazero.zero as zero

    def train(offload):
        torch.manual_seed(SEED)
        model = GPTModel(tiny_config())
        extra = {"offload_param": {"device": "cpu"}} if offload else {}
        cfg = ds_config(3, 1, CLIP, 0, GLOBAL_MICRO_ROWS, **MUON)
        cfg["zero_optimization"].update(extra)
        engine = zero.initialize(model, cfg)
        data = batches(3, 1, GLOBAL_MICRO_ROWS)
        for step in range(3):
            rows = data[step, 0]
            engine.backward(engine(rows[:, :-1], labels=rows[:, 1:]).mean())
            engine.step()
        return engine.consolidated_state_dict(rank0_only=False)

    plain, offloaded = train(False), train(True)
    assert all(torch.equal(plain[k], offloaded[k]) for k in plain)
