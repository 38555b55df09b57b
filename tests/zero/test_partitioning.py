"""Parameters partitioned over different groups in one engine, against one-process AdamW.

A toy model whose layers hold three kinds of parameters, on 4 data-parallel ranks:
``dense`` (the default: partitioned over all 4), ``expert`` (a different one on each half of the
ranks, like an expert on its expert-parallel rank: partitioned and reduced over that half) and
``shared`` (the same everywhere, partitioned over a half and replicated across the halves, like
FSDP2's HSDP). The reference trains every distinct parameter in one process: rank r's data goes
through the expert of r's half. Checkpoints saved so reload at 2 ranks with another stage.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megazero import mpu, zero
from megazero.zero import Partitioning
from megazero.zero.checkpoint import load_zero_state, save_zero_state
from tests.distributed import run_distributed

D, ROWS, LAYERS = 8, 3, 2
LR, BETAS, EPS, WD = 1e-2, (0.9, 0.95), 1e-8, 0.1


class Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense, self.expert, self.shared = (torch.nn.Linear(D, D) for _ in range(3))

    def forward(self, x):
        return x + torch.tanh(self.dense(x)) + 0.5 * torch.tanh(self.expert(x)) + 0.5 * torch.tanh(self.shared(x))


class Toy(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = torch.nn.Linear(D, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x).pow(2).mean()


def global_name(name: str, expert: int) -> str:
    return name.replace(".expert.", f".experts.{expert}.")


def initial(name: str, shape) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 % (2 ** 31))
    return torch.randn(shape, generator=g) * 0.4


def toy_for(expert: int) -> Toy:
    model = Toy()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(initial(global_name(n, expert), p.shape))
    return model


def data(steps: int, accum: int, world: int) -> torch.Tensor:
    return torch.randn(steps, accum, world, ROWS, D, generator=torch.Generator().manual_seed(5))


def config(stage: int, accum: int, clip: float, offload: bool = False) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": ROWS, "gradient_accumulation_steps": accum,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
            "gradient_clipping": clip}
    if offload:  # the optimizer's state (and ZeRO-3's parameters) on the host, per group as on the device
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        if stage == 3:
            cfg["zero_optimization"]["offload_param"] = {"device": "cpu"}
    return cfg


def _halves_and_across(world: int):
    """Every rank creates every group (torch requires it); returns this rank's half and across group."""
    half = world // 2
    halves = [dist.new_group(list(range(h * half, (h + 1) * half))) for h in range(2)]
    across = [dist.new_group([i, i + half]) for i in range(half)]
    rank = dist.get_rank()
    return rank // half, halves[rank // half], across[rank % half]


def _engine(stage: int, accum: int, clip: float, offload: bool = False):
    mpu.initialize_model_parallel(1)
    world = dist.get_world_size()
    expert, half_group, across_group = _halves_and_across(world)
    edp = Partitioning("edp", half_group)
    hsdp = Partitioning("hsdp", half_group, replicate=across_group)

    def partitioning(name, param):
        return edp if ".expert." in name else hsdp if ".shared." in name else None

    engine = zero.initialize(toy_for(expert), config(stage, accum, clip, offload), mpu=mpu, partitioning=partitioning,
                             param_names=lambda n: global_name(n, expert))
    return engine, expert


def _train(stage: int, accum: int, clip: float, steps: int, save_to: str | None = None, offload: bool = False):
    engine, expert = _engine(stage, accum, clip, offload)
    rank, world = dist.get_rank(), dist.get_world_size()
    xs, norms = data(steps, accum, world), []
    for step in range(steps):
        for a in range(accum):
            engine.backward(engine(xs[step, a, rank]))
            engine.step()
        norms.append(engine.get_global_grad_norm())
    if save_to is not None:
        save_zero_state(engine, save_to)
    counts = {k: v for k, v in engine.comm.calls.items() if k[1] in ("edp", "hsdp", "hsdp.replicas")}
    return norms, engine.full_master_tensors("master"), engine.full_master_tensors("exp_avg"), counts


def _load(stage: int, directory: str):
    engine, _ = _engine(stage, 1, 0.0)
    load_zero_state(engine, directory)
    return engine.full_master_tensors("master"), engine.full_master_tensors("exp_avg")


def reference(steps: int, accum: int, clip: float, world: int = 4):
    """Both halves' models share every module but the experts; rank r uses half r // (world/2)."""
    models = [toy_for(0), toy_for(1)]
    for i in range(LAYERS):
        models[1].layers[i].dense = models[0].layers[i].dense
        models[1].layers[i].shared = models[0].layers[i].shared
    models[1].head = models[0].head
    params = {global_name(n, e): p for e, m in enumerate(models) for n, p in m.named_parameters()}
    opt = torch.optim.AdamW(params.values(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD, fused=True)
    xs, norms = data(steps, accum, world), []
    for step in range(steps):
        for a in range(accum):
            loss = sum(models[r // (world // 2)](xs[step, a, r]) for r in range(world)) / (world * accum)
            loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(list(params.values()), clip if clip else float("inf"))))
        opt.step()
        opt.zero_grad()
    moments = {n: opt.state[p]["exp_avg"] for n, p in params.items()}
    return norms, {n: p.detach() for n, p in params.items()}, moments


def _close(got: dict, want: dict, names) -> None:
    for n in names:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)])
def test_groups_of_one_engine_train_like_one_process(stage, offload, tmp_path):
    steps, accum, clip = 3, 2, 0.5
    results = run_distributed(4, _train, stage, accum, clip, steps, str(tmp_path), offload)
    ref_norms, ref_params, ref_moments = reference(steps, accum, clip)
    assert any(n > clip for n in ref_norms), "clipping must be active for the norm to matter"
    for rank, (norms, masters, moments, counts) in enumerate(results):
        assert norms == pytest.approx(ref_norms, rel=1e-5)
        # each rank sees its own half's expert, every dense and shared parameter
        assert all(f"experts.{1 - rank // 2}." not in n for n in masters)
        assert any(f"experts.{rank // 2}." in n for n in masters)
        _close(masters, ref_params, masters)
        _close(moments, ref_moments, moments)
        # the groups' own collectives ran: partition traffic on the halves, replicas reduced across
        assert counts.get(("all_reduce", "hsdp.replicas"), 0) == steps * LAYERS  # one per flat group per step
        if stage >= 2:
            assert counts.get(("reduce_scatter", "edp"), 0) > 0 and counts.get(("reduce_scatter", "hsdp"), 0) > 0

    # Reload at 2 ranks, another stage: each tensor resharded along its own group.
    for load_stage in ({0: 3, 1: 2, 2: 0, 3: 1}[stage],):
        loaded = run_distributed(2, _load, load_stage, str(tmp_path))
        for rank, (masters, moments) in enumerate(loaded):
            assert any(f"experts.{rank}." in n for n in masters)
            _close(masters, ref_params, masters)
            _close(moments, ref_moments, moments)


def _group_over(peers: str):
    """Partition every parameter over this rank's TP peers (tp 2 x dp 2) or pipeline peers (pp 2 x dp 2);
    returns the refusal's message, None when accepted."""
    mpu.initialize_model_parallel(*((2, 1) if peers == "tp" else (1, 2)))
    group = mpu.get_tensor_model_parallel_group() if peers == "tp" else mpu.get_pipeline_model_parallel_group()
    part = Partitioning("edp", group)
    try:
        zero.initialize(toy_for(0), config(1, 1, 0.0), mpu=mpu, partitioning=lambda n, p: part)
    except ValueError as e:
        return str(e)
    return None


def test_a_partitioning_outside_the_pipeline_stage_is_refused():
    # TP peers lie within the stage (experts of an expert TP size below the TP size are partitioned
    # across TP ranks); another stage's ranks do not.
    assert run_distributed(4, _group_over, "tp") == [None] * 4
    for message in run_distributed(4, _group_over, "pp"):
        assert message is not None and "outside the pipeline stage" in message
