"""pretrain_gpt.py --load of a Megatron-LM torch_dist checkpoint: it resumes (or fine-tunes) at any megazero layout.

* The loader of full weights reads any source with safetensors' interface: a fake source gives what the
  safetensors file gives, weights, fp32 master, Adam's moments and step alike, reading only its rows.
* Megatron's opt_param_scheduler maps onto megazero's LR schedule; Megatron-LM's load_checkpoint's train state:
  the samples default to 0, the schedule is read only with the optimizer state, an iteration is needed.
* A checkpoint megatron-core wrote at tp 2 x pp 2 as a run with --no-save-optim does (the model and the args,
  no optimizer, no scheduler): --finetune at pp 1, tp 2 (--use-checkpoint-args), pp 2 and ZeRO-3 dp 2 gives the
  first losses of a one-process run from its converted full weights; --no-load-optim resumes at iteration 11
  with 80 samples consumed and the command line's LR schedule from its step 0, the same at pp 1 and at
  tp 2 x pp 2; each rank of tp 2 x dp 2 ZeRO-3 reads about its share. megatron-core's experts (ep 2) fine-tune
  alike at ep 1, ep 2 and tp 2 x ep 2.

megatron-core's optimizer state: tests/training/test_megatron_optimizer_resume.py.
"""
from __future__ import annotations

import json
import os

import pytest
import torch

from megazero.checkpoint.megatron_resume import megatron_scheduler_state
from megazero.zero.shard_io import CheckpointError
from tests.helpers import VOCAB
from tests.mcore import requires_mcore
from tests.training.test_layout_invariance import RTOL, flags, launch, write_corpus

# A Llama-like model's flags (other torch_dist tests share them).
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


def test_megatron_train_state_as_megatron_lm_loads_it():
    import argparse
    from types import SimpleNamespace

    from megazero.checkpoint.megatron_resume import _train_state

    sched = {"max_lr": 3e-4, "min_lr": 3e-5, "lr_warmup_steps": 16, "lr_decay_steps": 800, "lr_decay_style": "cosine",
             "num_steps": 80}

    def ckpt(args, **common):
        return SimpleNamespace(directory="DIR", iteration=None, args=args, common=common)

    saved = ckpt(argparse.Namespace(consumed_train_samples=80), iteration=10, opt_param_scheduler=sched)
    assert _train_state(saved, None, False, True)["lr_scheduler"]["num_steps"] == 80
    weights_only = _train_state(saved, None, False, False)
    assert (weights_only["iteration"], weights_only["consumed_samples"], weights_only["lr_scheduler"]) == (10, 80, None)
    no_samples = _train_state(ckpt(argparse.Namespace(), iteration=10), None, False, False)
    assert no_samples["consumed_samples"] == 0 and "sample 0" in no_samples["samples_note"]
    with pytest.raises(CheckpointError, match="no opt_param_scheduler.*--no-load-optim"):
        _train_state(ckpt(argparse.Namespace(consumed_train_samples=80), iteration=10), None, False, True)
    with pytest.raises(CheckpointError, match="no iteration.*--finetune"):
        _train_state(ckpt(None), None, False, False)
    assert _train_state(ckpt(None), None, True, False)["iteration"] == 0


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
    from megazero.checkpoint.torch_dist_source import open_torch_dist
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
def test_no_load_optim_resumes_a_checkpoint_saved_without_optimizer_state(mcore_run):
    """Megatron-LM's --no-save-optim save: no optimizer, no opt_param_scheduler; --no-load-optim resumes it."""
    import math

    runs, prefix, ckpt, _ = mcore_run
    # without the flag, as Megatron-LM's load: refused, rather than restart Adam's moments unasked
    with pytest.raises(AssertionError, match="holds no optimizer state.*add --no-load-optim"):
        launch(1, _base(prefix, 12) + ["--load", ckpt], runs, "resume_without_flag")
    got = {}
    for world, extra in ((1, []), (4, ["--tp", "2", "--pp", "2"])):
        name = f"resume_{world}"
        got[world] = launch(world, _base(prefix, 12) + [*extra, "--load", ckpt, "--no-load-optim"], runs, name)
        assert sorted(got[world]) == [11, 12], (name, sorted(got[world]))
        log = open(runs / f"{name}.log").read()
        assert "resumed from iteration 10 (80 samples)" in log and "freshly seeded" in log, log[-2000:]
        assert "LR schedule is this run's own from its step 0" in log, log[-2000:]
    for it in (11, 12):
        a, b = got[4][it]["lm_loss"], got[1][it]["lm_loss"]
        assert abs(a - b) <= RTOL * abs(b), f"iteration {it}: tp 2 x pp 2 loss {a} vs pp 1 {b}"
    # the command line's schedule from its step 0 (the log gives the lr after the step): sample 8 of a
    # warmup of 16, then sample 16, its end
    assert math.isclose(got[1][11]["lr"], 3e-4 * 8 / 16, rel_tol=1e-12), got[1][11]["lr"]
    assert math.isclose(got[1][12]["lr"], 3e-4, rel_tol=1e-12), got[1][12]["lr"]


def _read_share(ckpt: str, tp: int, stage: int) -> dict:
    """On each rank of a tp x dp engine: the bytes read from the .distcp files for its weights, and its share."""
    from megazero import mpu, zero
    from megazero.model import GPTModel
    from megazero.checkpoint.torch_dist_source import open_torch_dist
    from megazero.checkpoint.megatron_resume import read_torch_dist
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
