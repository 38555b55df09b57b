"""pretrain_gpt.py --load of a Megatron-LM torch_dist checkpoint: it resumes (or fine-tunes) at any megazero layout.

* The loader of full weights reads any source with safetensors' interface: a fake source gives what the
  safetensors file gives, weights, fp32 master, Adam's moments and step alike, reading only its rows.
* Megatron's opt_param_scheduler maps onto megazero's LR schedule.
* A checkpoint megatron-core wrote at tp 2 x pp 2: --finetune at pp 1, tp 2 (--use-checkpoint-args), pp 2 and
  ZeRO-3 dp 2 gives the first losses of a one-process run from its converted full weights; a resume continues
  at iteration 11 with 80 samples consumed and Megatron's LR, the same at pp 1 and at tp 2 x pp 2; another LR
  schedule is refused; each rank of tp 2 x dp 2 ZeRO-3 reads about its share. megatron-core's experts
  (ep 2) fine-tune alike at ep 1, ep 2 and tp 2 x ep 2.
* The optimizer (torch's DCP writing megatron-core's names for the state of a megazero run after 2
  iterations): iterations 3 and 4 resumed from the fully_reshardable layout at pp 1, tp 2, pp 2 and ZeRO-3
  dp 2, from a chained optimizer's and from the non-distributed optimizer's equal the uninterrupted run, as
  from megazero's own torch_dist save (its train state in common.pt); with --no-load-optim the weights only
  (iteration 4 then differs); a dp_reshardable optimizer is refused with the way out.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megazero.model.interop.megatron_dist import mcore_entries
from megazero.training.megatron_resume import megatron_scheduler_state
from megazero.zero.shard_io import CheckpointError
from tests.helpers import VOCAB
from tests.mcore import requires_mcore
from tests.training.test_layout_invariance import RTOL, flags, launch, write_corpus

MODEL = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]


# ---- the loader over a source --------------------------------------------------------------------------------

class _CountingSource:
    """A dict of full tensors behind safetensors' interface, counting the elements it hands out."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors, self.read = tensors, 0

    def keys(self):
        return list(self.tensors)

    def get_slice(self, name: str):
        source = self

        class _Slice:
            def get_shape(self):
                return list(source.tensors[name].shape)

            def __getitem__(self, index):
                out = source.tensors[name][index]
                source.read += out.numel()
                return out

        return _Slice()


def _TINY():
    from tests.zero.common import tiny_config

    return tiny_config(hidden_size=32, num_attention_heads=4, activation="swiglu", tie_embeddings=False, vocab_size=64)


def _engine(stage: int):
    from megazero import mpu, zero
    from megazero.model import GPTModel
    from tests.zero.common import ds_config

    torch.set_num_threads(1)
    mpu.initialize_model_parallel(1)
    torch.manual_seed(3)
    return zero.initialize(GPTModel(_TINY(), device="meta"), ds_config(stage, micro=2), mpu=mpu)


def _load_from_sources(path: str, stage: int) -> dict:
    """On each of 2 DP ranks: the same weights from the safetensors file and from a fake source; then master,
    moments and step from their own sources. What was read, and the differences from what was given."""
    from megazero.zero.checkpoint import load_full_weights_file
    from megazero.zero.optim import optimizer_step
    from megazero.zero.source_load import open_safetensors

    engine = _engine(stage)
    f = open_safetensors(path)
    full = {k: {n: f.get_tensor(f"{k}/{n}") for n in {x.split("/", 1)[1] for x in f.keys()}} for k in "wmab"}
    load_full_weights_file(engine, path.replace(".safetensors", "_w.safetensors"))
    from_file = engine.full_master_tensors()
    weights = _CountingSource(full["w"])
    load_full_weights_file(engine, weights, where="fake")
    master, moments = _CountingSource(full["m"]), {"exp_avg": _CountingSource(full["a"]),
                                                  "exp_avg_sq": _CountingSource(full["b"])}
    diffs = {"weights": max((engine.full_master_tensors()[n] - from_file[n]).abs().max().item() for n in full["w"])}
    read_weights = weights.read
    load_full_weights_file(engine, weights, master=master, moments=moments, step=7, where="fake")
    for key, ref in (("master", full["m"]), ("exp_avg", full["a"]), ("exp_avg_sq", full["b"])):
        got = engine.full_master_tensors(key)
        diffs[key] = max((got[n] - ref[n]).abs().max().item() for n in ref)
    try:
        load_full_weights_file(engine, weights, moments={"exp_avg": _CountingSource({}), "exp_avg_sq": master})
        refused = ""
    except CheckpointError as e:
        refused = str(e)
    own = sum(g.shard_numel for g in engine.groups)
    return {"diffs": diffs, "step": optimizer_step(engine.optimizer), "read": read_weights,
            "moment_read": moments["exp_avg"].read, "own": own, "total": sum(v.numel() for v in full["w"].values()),
            "refused": refused}


@pytest.mark.parametrize("stage", [0, 3])
def test_a_source_loads_weights_master_moments_and_step(tmp_path, stage):
    from safetensors.torch import save_file

    from megazero.model import GPTModel
    from tests.distributed import run_distributed

    model = GPTModel(_TINY(), device="meta")
    gen = torch.Generator().manual_seed(0)
    tensors = {f"{k}/{n}": torch.randn(p.shape, generator=gen) for k in "wmab" for n, p in model.named_parameters()}
    path = str(tmp_path / "all.safetensors")
    save_file(tensors, path)
    save_file({k[2:]: v for k, v in tensors.items() if k.startswith("w/")}, str(tmp_path / "all_w.safetensors"))
    for rank, o in enumerate(run_distributed(2, _load_from_sources, path, stage)):
        assert all(d == 0 for d in o["diffs"].values()), (rank, o["diffs"])
        assert o["step"] == 7 and "lacks the exp_avg" in o["refused"], o
        # ZeRO-0: every rank holds everything; ZeRO-3: its partition's rows only (whole rows: a little more),
        # the moments the same rows as the weights
        if stage == 0:
            assert o["read"] == o["moment_read"] == o["total"], o
        else:
            assert o["read"] == o["moment_read"] and o["own"] <= o["read"] <= 1.01 * o["own"] < 0.6 * o["total"], o
        print(f"ZeRO-{stage} dp 2 rank {rank}: read {o['read']} of {o['total']} weight elements, owns {o['own']}")


def test_megatron_scheduler_state_maps_onto_megazero():
    sd = {"max_lr": 3e-4, "lr_warmup_steps": 16, "num_steps": 80, "lr_decay_style": "cosine", "lr_decay_steps": 800,
          "min_lr": 3e-5, "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant", "wd_incr_steps": 800}
    assert megatron_scheduler_state(sd) == {"max_lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 16, "decay_steps": 800,
                                            "decay_style": "cosine", "num_steps": 80}
    legacy = {"start_lr": 1e-3, "min_lr": 0.0, "warmup_iter": 4, "end_iter": 40, "decay_style": "linear",
              "num_iters": 9, "start_wd": 0.0, "end_wd": 0.1, "wd_incr_style": "linear", "wd_incr_steps": 40}
    got = megatron_scheduler_state(legacy)
    assert (got["max_lr"], got["warmup_steps"], got["decay_steps"], got["num_steps"], got["end_wd"]) == (
        1e-3, 4, 40, 9, 0.1)
    with pytest.raises(CheckpointError, match="num_steps"):
        megatron_scheduler_state({"max_lr": 1.0})


# ---- a torch_dist checkpoint of a megazero run's state, written by torch's DCP in megatron-core's names ----

def _write_torch_dist(out: str, iteration: int, tensors: dict[str, torch.Tensor], common: dict) -> None:
    import torch.distributed.checkpoint as dcp

    directory = os.path.join(out, f"iter_{iteration:07d}")
    dcp.save(tensors, storage_writer=dcp.FileSystemWriter(directory), no_dist=True)
    torch.save(common, os.path.join(directory, "common.pt"))
    with open(os.path.join(directory, "metadata.json"), "w") as f:
        json.dump({"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                   "common_backend_version": 1}, f)
    with open(os.path.join(out, "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


def _stacked(config, full: dict[str, torch.Tensor], prefix: str = "") -> dict[str, torch.Tensor]:
    """megatron-core's global tensors (decoder layers stacked) from megazero's full ones."""
    out: dict[str, torch.Tensor] = {}
    for e in mcore_entries(config, per_layer=False):
        if e.name not in full:
            continue
        t = out.setdefault(prefix + e.key, torch.zeros(e.shape))
        t[e.index] = full[e.name]
    return out


def _to_torch_dist(saved: str, out: str, optimizer: str = "fully_reshardable", megazero: bool = False) -> None:
    """The megazero checkpoint ``saved`` (iteration 2) as Megatron-LM's torch_dist save of the same state; with
    ``megazero`` as megazero's own (its train state and config in common.pt, no Megatron args or scheduler).
    ``optimizer``: the distributed optimizer's 'fully_reshardable' or 'dp_reshardable' layout; 'chained' (two
    distributed optimizers, the output layer in the second, keys prefixed chained_<i>.); 'plain' (the
    non-distributed mixed-precision optimizer: master as fp32_param, the step per parameter)."""
    from megazero.training.checkpoint_reader import open_checkpoint
    from tests.mcore import megatron_args

    config, reader, _ = open_checkpoint(saved, 2)
    names = list(reader.names)
    full = {k: {n: reader.full(n, k) for n in names} for k in ("master", "exp_avg", "exp_avg_sq")}
    tensors = _stacked(config, full["master"])
    if optimizer in ("fully_reshardable", "chained", "plain"):
        master = "fp32_param" if optimizer == "plain" else "param"
        for key, prefix in (("master", master), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            if optimizer == "chained":
                for i, part in enumerate(({n: v for n, v in full[key].items() if not n.startswith("output_layer")},
                                          {n: v for n, v in full[key].items() if n.startswith("output_layer")})):
                    tensors.update(_stacked(config, part, f"chained_{i}.optimizer.state.{prefix}."))
            else:
                tensors.update(_stacked(config, full[key], f"optimizer.state.{prefix}."))
    else:  # flat per-bucket buffers
        flat = torch.cat([full["exp_avg"][n].reshape(-1) for n in names])
        tensors["optimizer.distributed.dp_group_idx_0.gbuf_idx_0.bucket_idx_0.exp_avg"] = flat
    state = json.load(open(os.path.join(saved, "iter_0000002", "train_state.json")))
    sched = state["lr_scheduler"]
    step = reader.first_meta["optimizer_step"]
    args = megatron_args(config, 1, 1, 1, 1, iteration=2, seed=11, optimizer=True, grouped_gemm=False,
                         optimizer_format=optimizer, consumed_train_samples=state["consumed_samples"])
    common = {"args": args, "checkpoint_version": 3.0, "iteration": 2,
              "opt_param_scheduler": {"max_lr": sched["max_lr"], "min_lr": sched["min_lr"],
                                      "lr_warmup_steps": sched["warmup_steps"], "lr_decay_steps": sched["decay_steps"],
                                      "lr_decay_style": sched["decay_style"], "num_steps": sched["num_steps"],
                                      "start_wd": 0.01, "end_wd": 0.01, "wd_incr_style": "constant",
                                      "wd_incr_steps": sched["decay_steps"]},
              "optimizer": {"optimizer": {"param_groups": [{"lr": 0.0, "step": step}, {"lr": 0.0, "step": step}]},
                            "param_state_sharding_type": optimizer}}
    if optimizer == "chained":
        common["optimizer"] = {i: {"optimizer": {"param_groups": [{"lr": 0.0, "step": step}]},
                                   "param_state_sharding_type": "fully_reshardable"} for i in range(2)}
    elif optimizer == "plain":
        common["optimizer"] = {"optimizer": {"param_groups": [{"lr": 0.0, "params": [0, 1]}],
                                             "state": {0: {"step": torch.tensor(float(step))},
                                                       1: {"step": torch.tensor(float(step))}}}}
    if megazero:
        common = {"iteration": 2, "optimizer": common["optimizer"],
                  "megazero": {"train_state": json.dumps(state),
                               "config": open(os.path.join(saved, "iter_0000002", "config.json")).read()}}
    _write_torch_dist(out, 2, tensors, common)


@pytest.fixture(scope="module")
def optim_run(tmp_path_factory):
    """A megazero run of 4 iterations saved every iteration, and its iteration 2 as two torch_dist checkpoints."""
    runs = tmp_path_factory.mktemp("megatron_resume_optim")
    prefix = write_corpus(runs)
    saved = str(runs / "megazero")
    ref = launch(1, flags(prefix, *MODEL, layers=2, iters=4) + ["--save", saved, "--save-interval", "1"], runs, "ref")
    _to_torch_dist(saved, str(runs / "tdist"))
    _to_torch_dist(saved, str(runs / "tdist_flat"), optimizer="dp_reshardable")
    _to_torch_dist(saved, str(runs / "tdist_megazero"), megazero=True)
    for layout in ("chained", "plain"):
        _to_torch_dist(saved, str(runs / f"tdist_{layout}"), optimizer=layout)
    return runs, prefix, ref


def _assert_same(got: dict, ref: dict, what: str, iterations=(3, 4)) -> None:
    assert sorted(got) == list(iterations), (what, sorted(got))
    for it in iterations:
        for key in ("lm_loss", "grad_norm"):
            a, b = got[it][key], ref[it][key]
            assert abs(a - b) <= RTOL * abs(b), f"{what}: iteration {it} {key} {a} vs the uninterrupted run's {b}"


@pytest.mark.parametrize("world,extra", [(1, []), (2, ["--tp", "2"]), (2, ["--pp", "2"]), (2, ["--zero-stage", "3"])])
def test_optimizer_state_resumes_as_the_uninterrupted_run(optim_run, world, extra):
    runs, prefix, ref = optim_run
    name = f"tdist_{world}_{'_'.join(extra) or 'pp1'}"
    got = launch(world, flags(prefix, *MODEL, *extra, layers=2, iters=4) + ["--load", str(runs / "tdist")], runs, name)
    _assert_same(got, ref, name)
    log = open(runs / f"{name}.log").read()
    assert "weights and optimizer" in log and "resumed from iteration 2 (16 samples)" in log, log[-2000:]


@pytest.mark.parametrize("layout", ["chained", "plain"])
def test_other_optimizer_layouts_of_model_shaped_state_resume_alike(optim_run, layout):
    runs, prefix, ref = optim_run
    got = launch(1, flags(prefix, *MODEL, layers=2, iters=4) + ["--load", str(runs / f"tdist_{layout}")], runs, layout)
    _assert_same(got, ref, f"the {layout} optimizer")
    log = open(runs / f"{layout}.log").read()
    assert "weights and optimizer" in log and "step count is not in common.pt" not in log, log[-2000:]


def test_megazero_torch_dist_resumes_from_its_own_train_state(optim_run):
    runs, prefix, ref = optim_run
    got = launch(1, flags(prefix, *MODEL, layers=2, iters=4) + ["--load", str(runs / "tdist_megazero"), "--ckpt-step",
                                                                 "2"], runs, "mz")
    _assert_same(got, ref, "megazero's torch_dist")


def test_no_load_optim_reads_the_weights_only(optim_run):
    runs, prefix, ref = optim_run
    got = launch(1, flags(prefix, *MODEL, layers=2, iters=4) + ["--load", str(runs / "tdist"), "--no-load-optim"],
                 runs, "no_optim")
    assert sorted(got) == [3, 4]
    assert abs(got[3]["lm_loss"] - ref[3]["lm_loss"]) <= RTOL * ref[3]["lm_loss"]  # the same weights
    assert abs(got[4]["lm_loss"] - ref[4]["lm_loss"]) > 1e-4 * ref[4]["lm_loss"]  # a fresh Adam moved them otherwise


def test_flat_buffer_optimizer_is_refused_with_the_way_out(optim_run):
    from tests.launch import in_pool

    runs, prefix, _ = optim_run
    args = flags(prefix, *MODEL, layers=2, iters=4) + ["--load", str(runs / "tdist_flat")]
    run = in_pool(1, args, cwd=runs)
    assert run.returncode != 0
    assert "dp_reshardable" in run.output and "--no-load-optim" in run.output, run.output[-2000:]
    got = launch(1, args + ["--no-load-optim"], runs, "flat_weights_only")
    assert sorted(got) == [3, 4]


# ---- a checkpoint megatron-core wrote at tp 2 x pp 2 ---------------------------------------------------------

def _base(prefix: str, iters: int) -> list[str]:
    """flags() without the model: it comes from the checkpoint (no model shape flags)."""
    out = flags(prefix, iters=iters)
    drop = {"--num-layers", "--hidden-size", "--num-attention-heads", "--lr", "--min-lr", "--lr-warmup-iters"}
    kept = [a for i, a in enumerate(out) if a not in drop and (i == 0 or out[i - 1] not in drop)]
    return kept + ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "2", "--lr-decay-iters", "100"]


@pytest.fixture(scope="module")
def mcore_run(tmp_path_factory):
    from megazero.model.config import GPTConfig
    from megazero.training.torch_dist_source import open_torch_dist
    from tests.mcore import write_mcore_checkpoint

    runs = tmp_path_factory.mktemp("megatron_resume_mcore")
    config = GPTConfig(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16,
                       max_position_embeddings=16, make_vocab_size_divisible_by=32, activation="swiglu",
                       normalization="rmsnorm", position_embedding_type="rope", add_bias_linear=False,
                       tie_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0)
    ckpt = str(runs / "mcore_tp2_pp2")
    write_mcore_checkpoint(ckpt, config, tp=2, pp=2, iteration=10)
    from safetensors.torch import save_file

    saved_config, source, _ = open_torch_dist(ckpt)  # the converted full weights, for the one-process run
    full = str(runs / "full")
    os.makedirs(full)
    save_file({n: source.get_tensor(n).contiguous() for n in source.keys()},
              os.path.join(full, "model_full.safetensors"))
    json.dump(saved_config.to_dict(), open(os.path.join(full, "config.json"), "w"))
    prefix = write_corpus(runs)
    ref = launch(1, _base(prefix, 2) + ["--pretrained-checkpoint", full], runs, "from_full")
    return runs, prefix, ckpt, ref


@requires_mcore
@pytest.mark.parametrize("world,extra", [(1, []), (2, ["--tp", "2", "--use-checkpoint-args"]), (2, ["--pp", "2"]),
                                         (2, ["--zero-stage", "3"])])
def test_finetune_from_megatron_core_at_any_layout(mcore_run, world, extra):
    runs, prefix, ckpt, ref = mcore_run
    name = f"finetune_{world}_{'_'.join(extra) or 'pp1'}"
    got = launch(world, _base(prefix, 2) + [*extra, "--load", ckpt, "--finetune"], runs, name)
    assert sorted(got) == [1, 2], (name, sorted(got))
    for it in (1, 2):
        a, b = got[it]["lm_loss"], ref[it]["lm_loss"]
        assert abs(a - b) <= RTOL * abs(b), f"{name}: iteration {it} loss {a} vs the converted weights' {b}"


@requires_mcore
def test_resume_from_megatron_core_continues_its_run(mcore_run):
    import math

    runs, prefix, ckpt, _ = mcore_run
    got = {}
    for world, extra in ((1, []), (4, ["--tp", "2", "--pp", "2"])):
        name = f"resume_{world}"
        got[world] = launch(world, _base(prefix, 12) + [*extra, "--load", ckpt], runs, name)
        assert sorted(got[world]) == [11, 12], (name, sorted(got[world]))
        log = open(runs / f"{name}.log").read()
        assert "resumed from iteration 10 (80 samples)" in log and "freshly seeded" in log, log[-2000:]
    for it in (11, 12):
        a, b = got[4][it]["lm_loss"], got[1][it]["lm_loss"]
        assert abs(a - b) <= RTOL * abs(b), f"iteration {it}: tp 2 x pp 2 loss {a} vs pp 1 {b}"
    from tests.launch import in_pool

    changed = in_pool(1, _base(prefix, 12) + ["--load", ckpt, "--lr", "1e-3"], cwd=runs)  # another schedule
    assert changed.returncode != 0 and "--use-checkpoint-opt_param-scheduler" in changed.output, changed.output[-2000:]
    # Megatron's schedule at its sample 88: warmup 16, cosine to sample 800
    expected = 3e-5 + (3e-4 - 3e-5) * 0.5 * (1 + math.cos(math.pi * (88 - 16) / (800 - 16)))
    assert abs(got[1][11]["lr"] - expected) <= 1e-9, (got[1][11]["lr"], expected)


def _read_share(ckpt: str, tp: int, stage: int) -> dict:
    """On each rank of a tp x dp engine: the bytes read from the .distcp files for its weights, and its share."""
    from megazero import mpu, zero
    from megazero.model import GPTModel
    from megazero.training.torch_dist_source import open_torch_dist
    from megazero.training.megatron_resume import read_torch_dist
    from tests.zero.common import ds_config

    torch.set_num_threads(1)
    mpu.initialize_model_parallel(tp)
    config, _, _ = open_torch_dist(ckpt)
    engine = zero.initialize(GPTModel(config, device="meta"), ds_config(stage, micro=2), mpu=mpu)
    state = read_torch_dist(ckpt, engine, config, load_optimizer=False)
    total = sum(p.numel() for p in GPTModel(config, tp_group=None, device="meta").parameters()) * 4 if tp == 1 else None
    return {"read": state["bytes_read"], "own": sum(g.shard_numel for g in engine.groups) * 4, "total": total}


@requires_mcore
def test_each_rank_reads_about_its_share(mcore_run):
    from tests.distributed import run_distributed

    _, _, ckpt, _ = mcore_run
    whole = run_distributed(1, _read_share, ckpt, 1, 0)[0]
    assert whole["read"] >= whole["total"]  # one rank: everything, once, and the blobs' headers
    for rank, o in enumerate(run_distributed(4, _read_share, ckpt, 2, 3)):
        print(f"tp 2 x dp 2 ZeRO-3 rank {rank}: read {o['read']} B of {whole['read']} B, its share {o['own']} B")
        assert o["read"] < 0.4 * whole["read"], o


@requires_mcore
def test_mixture_of_experts_from_megatron_core_at_any_expert_layout(tmp_path):
    """megatron-core's experts (saved at ep 2, the routers' expert biases among the buffers) fine-tune alike at
    ep 1, ep 2 and tp 2 x ep 2 with sequence parallelism."""
    from megazero.model.config import GPTConfig
    from tests.mcore import write_mcore_checkpoint

    config = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16,
                       max_position_embeddings=16, make_vocab_size_divisible_by=32, activation="swiglu",
                       normalization="rmsnorm", position_embedding_type="rope", add_bias_linear=False,
                       tie_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0, num_experts=4,
                       moe_router_topk=2, moe_ffn_hidden_size=16, moe_router_score_function="sigmoid",
                       moe_router_enable_expert_bias=True)
    ckpt = str(tmp_path / "moe")
    write_mcore_checkpoint(ckpt, config, ep=2, iteration=10)
    prefix = write_corpus(tmp_path)
    runs = {}
    for world, extra in ((1, []), (2, ["--expert-model-parallel-size", "2"]),
                         (4, ["--tp", "2", "--expert-model-parallel-size", "2", "--sequence-parallel"])):
        runs[world] = launch(world, _base(prefix, 2) + ["--num-experts", "4", *extra, "--load", ckpt, "--finetune"],
                             tmp_path, f"moe_{world}")
    for world in (2, 4):
        for it in (1, 2):
            a, b = runs[world][it]["lm_loss"], runs[1][it]["lm_loss"]
            assert abs(a - b) <= RTOL * abs(b), f"world {world}: iteration {it} loss {a} vs one process {b}"
