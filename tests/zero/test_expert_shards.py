"""Experts sharded other than over TP (an expert tensor-parallel size ETP other than TP): their
checkpoints read back whole, and load at any TP x ETP x EP layout and ZeRO stage.

A toy model of four experts (a stride-2 fc1 split along rows, an fc2 split along columns), a
TP-sharded dense weight and a TP-replicated norm. The ranks are laid out as in Megatron-core:
the stage's ranks (tp fastest) again as etp x ep x edp, etp fastest. A rank holds the experts
of its EP rank, as shard (etp rank, etp) marked by ``tp_shard`` when ETP differs from TP;
experts are partitioned over their expert-data-parallel group. Values are a function of the
global name, so every layout's expected shard is a slice of one full tensor.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.distributed as dist

from megazero import mpu, zero
from megazero.mpu.sharding import full_from_shards, shard_of_full
from megazero.zero import Partitioning
from megazero.zero.checkpoint import CheckpointReader, load_full_weights_file, load_zero_state, save_zero_state
from tests.distributed import run_distributed

H, F, EXPERTS = 4, 4, 4
# name pattern -> (full shape, partition dim, stride); None: TP-replicated
EXPERT = {"linear_fc1.weight": ((2 * F, H), 0, 2), "linear_fc2.weight": ((H, F), 1, 1)}
DENSE = {"layers.0.mlp.dense.weight": ((2 * F, H), 0, 1), "layers.0.norm.weight": ((H,), None, 1)}


def specs() -> dict[str, tuple]:
    """Every parameter of the full model: name -> (full shape, partition dim or None, stride)."""
    out = dict(DENSE)
    for e in range(EXPERTS):
        out.update({f"layers.0.mlp.experts.{e}.{k}": v for k, v in EXPERT.items()})
    return out


def full_value(name: str) -> torch.Tensor:
    shape = specs()[name][0]
    g = torch.Generator().manual_seed(sum(map(ord, name)) * 7919 % (2 ** 31))
    return torch.randn(shape, generator=g)


class Toy(torch.nn.Module):
    def forward(self, x):
        return sum((p * p).sum() for p in self.parameters()) * x


def _add(root: torch.nn.Module, name: str, p: torch.nn.Parameter) -> None:
    *path, leaf = name.split(".")
    m = root
    for part in path:
        if not hasattr(m, part):
            m.add_module(part, torch.nn.Module())
        m = getattr(m, part)
    m.register_parameter(leaf, p)


def _param(name: str, rank: int, world: int, own: bool, group) -> torch.nn.Parameter:
    """Shard (rank, world) of ``name``'s full value; ``own``: marked with ``tp_shard``."""
    _, dim, stride = specs()[name]
    full = full_value(name)
    p = torch.nn.Parameter(full.clone() if dim is None else shard_of_full(full, dim, stride, rank, world))
    if dim is not None:
        p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, stride
        if own:
            p.tp_shard, p.tp_shard_group = (rank, world), group
    return p


def _groups(key):
    """One group per value of ``key(rank)`` (every rank creates each, in order); returns this
    rank's, None when it would hold this rank alone."""
    world, mine = dist.get_world_size(), None
    values = sorted({key(r) for r in range(world)})
    for v in values:
        ranks = [r for r in range(world) if key(r) == v]
        g = dist.new_group(ranks) if len(ranks) > 1 else None
        if v == key(dist.get_rank()):
            mine = g
    return mine


def _engine(tp: int, etp: int, ep: int, stage: int):
    """This rank's engine at tp x etp x ep (one pipeline stage, dp = world / tp)."""
    mpu.initialize_model_parallel(tp)
    rank, world = dist.get_rank(), dist.get_world_size()
    etp_rank, ep_rank = rank % etp, (rank // etp) % ep
    etp_group = _groups(lambda r: r // etp)
    edp_group = _groups(lambda r: r % (etp * ep))
    tp_rank, own = mpu.get_tensor_model_parallel_rank(), etp != tp
    model = Toy()
    for name in DENSE:
        _add(model, name, _param(name, tp_rank, tp, False, None))
    per = EXPERTS // ep
    for e in range(ep_rank * per, (ep_rank + 1) * per):
        for k in EXPERT:
            name = f"layers.0.mlp.experts.{e}.{k}"
            _add(model, name, _param(name, etp_rank, etp, own, etp_group))
    edp = Partitioning("edp", edp_group)
    part = None if ep == 1 and not own else (lambda n, p: edp if ".experts." in n else None)
    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 0.1, "weight_decay": 0.0}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    return zero.initialize(model, cfg, mpu=mpu, partitioning=part)


def _coordinates(engine) -> dict[str, tuple[int, int]]:
    """name -> the (rank, world) of the full tensor this rank's parameter is."""
    tp_rank, tp = engine.tp_rank, engine.tp_size
    out = {}
    for g in engine.groups:
        for s in g.slots:
            sharded = getattr(s.param, "tensor_model_parallel", False)
            out[s.name] = tuple(getattr(s.param, "tp_shard", (tp_rank, tp))) if sharded else (0, 1)
    return out


def _save(tp, etp, ep, directory):
    engine = _engine(tp, etp, ep, 1)
    engine.backward(engine(torch.ones(())))
    engine.step()
    save_zero_state(engine, directory)
    coords = _coordinates(engine)
    return {k: {n: (coords[n], v) for n, v in engine.full_master_tensors(k).items()} for k in ("master", "exp_avg")}


def _load(tp, etp, ep, stage, directory, full_file=None):
    engine = _engine(tp, etp, ep, stage)
    if full_file is None:
        load_zero_state(engine, directory)
    else:
        load_full_weights_file(engine, full_file)
        engine.publish_params()
    coords = _coordinates(engine)
    out = {k: {n: (coords[n], v) for n, v in engine.full_master_tensors(k).items()} for k in ("master", "exp_avg")}
    out["consolidated"] = engine.consolidated_state_dict(rank0_only=False)
    return out


def _assemble(per_rank: list[dict]) -> dict[str, torch.Tensor]:
    """Full tensors from every rank's ``name -> ((rank, world), local)``."""
    shards: dict[str, dict[int, torch.Tensor]] = {}
    worlds = {}
    for values in per_rank:
        for n, ((r, w), v) in values.items():
            shards.setdefault(n, {})[r] = v
            worlds[n] = w
    out = {}
    for n, by_rank in shards.items():
        assert sorted(by_rank) == list(range(worlds[n])), (n, sorted(by_rank))
        _, dim, stride = specs()[n]
        out[n] = full_from_shards([by_rank[r] for r in range(worlds[n])], dim or 0, stride)
    return out


def _check(per_rank: list[dict], full: dict[str, torch.Tensor], key: str) -> None:
    seen = set()
    for values in per_rank:
        for n, ((r, w), v) in values.items():
            _, dim, stride = specs()[n]
            want = full[n] if w == 1 else shard_of_full(full[n], dim, stride, r, w)
            torch.testing.assert_close(v, want, atol=0, rtol=0, msg=lambda m: f"{key} {n} shard {r}/{w}: {m}")
            seen.add(n)
    assert seen == set(specs()), sorted(set(specs()) - seen)


# (world, tp, etp, ep): each expert whole on one TP rank (edp = DP); whole on both TP ranks,
# partitioned across them (edp spans TP); shard rank = TP rank % 2 of world 2; ETP = TP
# (no tp_shard); ETP > TP (shards over DP ranks, shard index beyond the TP size).
LAYOUTS = {"tp2-etp1-ep2": (4, 2, 1, 2), "tp2-etp1-ep1": (2, 2, 1, 1), "tp4-etp2-ep2": (4, 4, 2, 2),
           "tp2-etp2-ep1": (2, 2, 2, 1), "tp1-etp2-ep1": (2, 1, 2, 1)}
LOADS = [("tp1", (1, 1, 1, 1), 0), ("tp2-etp2-ep1", LAYOUTS["tp2-etp2-ep1"], 3),
         ("tp2-etp1-ep2", LAYOUTS["tp2-etp1-ep2"], 2), ("tp4-etp2-ep2", LAYOUTS["tp4-etp2-ep2"], 1),
         ("tp1-etp2-ep1", LAYOUTS["tp1-etp2-ep1"], 3)]


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def saved(request, tmp_path_factory):
    world, tp, etp, ep = LAYOUTS[request.param]
    directory = str(tmp_path_factory.mktemp(f"experts_{request.param}"))
    out = run_distributed(world, _save, tp, etp, ep, directory)
    full = {k: _assemble([o[k] for o in out]) for k in ("master", "exp_avg")}
    assert set(full["master"]) == set(specs())
    return directory, full, ep == 1 and etp == tp


def test_every_parameter_reads_back_whole_and_in_shards(saved):
    directory, full, _ = saved
    reader = CheckpointReader(directory)
    assert set(reader.names) == set(specs())
    for n, (shape, dim, stride) in specs().items():
        assert reader.full_shape(n) == list(shape)
        for key in ("master", "exp_avg"):
            torch.testing.assert_close(reader.full(n, key), full[key][n], atol=0, rtol=0, msg=lambda m: f"{n}: {m}")
        if dim is not None:
            for r in range(4):
                want = shard_of_full(full["master"][n], dim, stride, r, 4)
                torch.testing.assert_close(reader.tp_shard(n, r, 4), want, atol=0, rtol=0)


@pytest.mark.parametrize("label,layout,stage", LOADS, ids=[x[0] for x in LOADS])
def test_loads_at_any_expert_layout(saved, label, layout, stage):
    directory, full, _ = saved  # experts saved in the default partitioning load where each rank holds some
    world, tp, etp, ep = layout
    out = run_distributed(world, _load, tp, etp, ep, stage, directory)
    for key in ("master", "exp_avg"):
        _check([o[key] for o in out], full[key], key)
    for o in out:  # gathered over each parameter's own shard group, every expert from the ranks holding it
        assert set(o["consolidated"]) >= set(full["master"]), sorted(set(full["master"]) - set(o["consolidated"]))
        for n, v in o["consolidated"].items():
            torch.testing.assert_close(v, full["master"][n], atol=0, rtol=0, msg=lambda m: f"consolidated {n}: {m}")


def test_full_weights_file_loads_at_expert_layouts(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "model_full.safetensors")
    full = {n: full_value(n) * 3 for n in specs()}
    save_file(full, path)
    for world, tp, etp, ep in (LAYOUTS["tp4-etp2-ep2"], LAYOUTS["tp2-etp1-ep1"]):
        for stage in (1, 3):
            out = run_distributed(world, _load, tp, etp, ep, stage, None, path)
            _check([o["master"] for o in out], full, "master")


def _strip_shards(directory: str) -> None:
    """Rewrite every shard file's metadata without ``"shard"``: as written before slots recorded it."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    for f in (x for x in os.listdir(directory) if x.startswith("zero_rank")):
        path = os.path.join(directory, f)
        with safe_open(path, framework="pt") as h:
            meta = json.loads(h.metadata()["megazero"])
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        for g in meta["groups"]:
            for s in g["slots"]:
                s.pop("shard", None)
        save_file(tensors, path, metadata={"megazero": json.dumps(meta)})


def test_a_checkpoint_without_shard_metadata_is_its_files_tp_shards(tmp_path):
    directory = str(tmp_path / "old")
    world, tp, etp, ep = LAYOUTS["tp2-etp2-ep1"]
    out = run_distributed(world, _save, tp, etp, ep, directory)
    full = _assemble([o["master"] for o in out])
    _strip_shards(directory)
    reader = CheckpointReader(directory)
    for n in specs():
        torch.testing.assert_close(reader.full(n), full[n], atol=0, rtol=0)
    loaded = run_distributed(2, _load, *LAYOUTS["tp2-etp1-ep1"][1:], 1, directory)
    _check([o["master"] for o in loaded], full, "master")
