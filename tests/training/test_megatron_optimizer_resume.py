"""pretrain_gpt.py --load of megatron-core's own optimizer state: the resumed run continues as megatron-core's does.

megatron-core trains a model on 2 gloo ranks (data parallel 2) with its distributed Adam, saves it after
iteration 2 in both sharding types of its distributed optimizer (or with its plain Adam) and trains on to
iteration 4
(:func:`tests.mcore.train_mcore`, on the samples megazero's ``--mock-data`` reads). megazero resumes each save
and must give megatron-core's own losses and gradient norms of iterations 3 and 4 (fp32: to 2e-5):

* ``fully_reshardable`` at 1 process and at tp 2; ``dp_reshardable`` (Megatron's default) at 1 process and at
  data parallel 2 with ZeRO-3, the layout that saved it; a mixture of experts saved at expert parallel 2 (a
  chained optimizer: its expert part apart) from dp_reshardable at ep 2 and from fully_reshardable at 1
  process; the non-distributed optimizer's state (Adam's moments beside fp32 weights, its common step);
* the master and Adam's moments read from the dp_reshardable buckets equal those megatron-core wrote in its
  canonical fully_reshardable form, and buckets placed in another order are refused by the master's check;
* megazero's order of megatron-core's parameters is its ``named_parameters()`` order, for dense, biased and
  query/key-normed, mixture-of-experts (shared expert, gate) and multi-latent attention models;
* with --no-load-optim the weights only (iteration 3's loss, not 4's) and the command line's LR schedule
  from its step 0; a dp_reshardable save at another tp, and another LR schedule, are refused with the way out.
"""
from __future__ import annotations

import argparse

import pytest
import torch

from megazero.model.config import GPTConfig
from tests.helpers import VOCAB
from tests.mcore import requires_mcore
from tests.training.test_layout_invariance import RTOL, launch

pytestmark = requires_mcore

DENSE = GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB + 1, seq_length=16,
                  max_position_embeddings=16, make_vocab_size_divisible_by=32, activation="swiglu",
                  normalization="rmsnorm", position_embedding_type="rope", add_bias_linear=False,
                  tie_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0)
MOE = GPTConfig.from_dict({**DENSE.to_dict(), "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16})
# Megatron-LM's training arguments of the megatron-core run, and the same run's megazero flags.
TRAIN = dict(micro_batch_size=2, global_batch_size=8, train_iters=4, lr=2e-2, min_lr=1e-3, lr_decay_style="cosine",
             lr_warmup_iters=1, clip_grad=1.0, seed=11)
FLAGS = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "4", "--lr", "2e-2", "--min-lr",
         "1e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--clip-grad", "1.0", "--seed", "11",
         "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--seq-length", "16",
         "--log-interval", "1", "--eval-iters", "0", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    """megatron-core's dense run: (directory with fully_reshardable/ and dp_reshardable/, its metrics)."""
    from tests.mcore import train_mcore

    out = tmp_path_factory.mktemp("mcore_dense")
    return out, train_mcore(str(out), DENSE, dp=2, **TRAIN)


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    """megatron-core's mixture of experts at expert parallel 2 x data parallel 2: a chained optimizer."""
    from tests.mcore import train_mcore

    out = tmp_path_factory.mktemp("mcore_moe")
    return out, train_mcore(str(out), MOE, ep=2, dp=2, **TRAIN)


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """megatron-core's non-distributed Adam (Megatron-LM without --use-distributed-optimizer) at dp 2."""
    from tests.mcore import train_mcore

    out = tmp_path_factory.mktemp("mcore_plain")
    return out, train_mcore(str(out), DENSE, dp=2, formats=("non_distributed",), **TRAIN)


def _continues(got: dict, ref: dict, what: str) -> None:
    assert sorted(got) == [3, 4], (what, sorted(got))
    for it in (3, 4):
        for key in ("lm_loss", "grad_norm"):
            a, b = got[it][key], ref[it][key]
            assert abs(a - b) <= RTOL * abs(b), f"{what}: iteration {it} {key} {a} vs megatron-core's {b}"


@pytest.mark.parametrize("fmt,world,extra", [("fully_reshardable", 1, []), ("fully_reshardable", 2, ["--tp", "2"]),
                                             ("dp_reshardable", 1, []), ("dp_reshardable", 2, ["--zero-stage", "3"])])
def test_resume_continues_as_megatron_core_does(dense, fmt, world, extra):
    out, ref = dense
    name = f"{fmt}_{world}_{'_'.join(extra) or 'pp1'}"
    got = launch(world, FLAGS + extra + ["--load", str(out / fmt)], out, name)
    _continues(got, ref, name)
    log = open(out / f"{name}.log").read()
    assert "weights and optimizer" in log and "resumed from iteration 2 (16 samples)" in log, log[-2000:]


@pytest.mark.parametrize("fmt,world,extra", [("dp_reshardable", 2, ["--ep", "2"]), ("fully_reshardable", 1, [])])
def test_a_chained_optimizer_of_experts_resumes_alike(moe, fmt, world, extra):
    out, ref = moe
    name = f"moe_{fmt}_{world}"
    _continues(launch(world, FLAGS + extra + ["--load", str(out / fmt)], out, name), ref, name)


def test_the_non_distributed_optimizer_resumes_alike(plain):
    out, ref = plain
    _continues(launch(1, FLAGS + ["--load", str(out / "non_distributed")], out, "plain"), ref, "non-distributed")
    log = open(out / "plain.log").read()
    assert "weights and optimizer" in log and "step count is not in the checkpoint" not in log, log[-2000:]


def _read(path: str, impl=None) -> dict:
    """One rank (ZeRO-1): the master and moments megazero reads from ``path``; with ``impl`` the dp_reshardable
    buckets placed as that layer spec's module order would (the errors of each parameter's master read)."""
    from megazero import mpu, zero
    from megazero.model import GPTModel
    from megazero.checkpoint.megatron_resume import read_torch_dist
    from megazero.checkpoint.torch_dist import TorchDistCheckpoint
    from megazero.checkpoint.torch_dist_buckets import BucketLayout, BucketSource
    from megazero.checkpoint.torch_dist_source import MegatronDistSource, entries_for_checkpoint, open_torch_dist
    from megazero.zero.shard_io import CheckpointError
    from tests.zero.common import ds_config

    torch.set_num_threads(1)
    mpu.initialize_model_parallel(1)
    config, _, _ = open_torch_dist(path)
    engine = zero.initialize(GPTModel(config, device="meta"), ds_config(1, micro=2), mpu=mpu)
    if impl is None:
        read_torch_dist(path, engine, config)
        return {k: engine.full_master_tensors(k) for k in ("master", "exp_avg", "exp_avg_sq")}
    ckpt = TorchDistCheckpoint(path)
    table = entries_for_checkpoint(ckpt, config)
    args = argparse.Namespace(**{**vars(ckpt.args), "transformer_impl": impl})
    coords = dict(tp=1, tp_rank=0, pp=1, pp_rank=0, ep=1, ep_rank=0, etp=1, etp_rank=0)
    source = BucketSource(ckpt, BucketLayout(ckpt, engine, table, args, coords), "param",
                          MegatronDistSource(ckpt, config, entries=table))
    errors = {}
    for name in source.keys():
        try:
            source.get_slice(name)[:]
        except CheckpointError as e:
            errors[name] = str(e)
    return errors


def test_the_buckets_hold_what_megatron_core_canonicalises(dense):
    from tests.distributed import run_distributed

    out, _ = dense
    buckets = run_distributed(1, _read, str(out / "dp_reshardable"))[0]
    canonical = run_distributed(1, _read, str(out / "fully_reshardable"))[0]
    for key in canonical:
        assert sorted(buckets[key]) == sorted(canonical[key])
        for name, t in canonical[key].items():
            assert torch.equal(buckets[key][name], t), (key, name)
    assert all(canonical["exp_avg_sq"][n].abs().sum() > 0 for n in canonical["exp_avg_sq"])  # two real steps
    # the Transformer Engine spec's order (a layer's norms inside its linears): the walk fits, the master does not
    errors = run_distributed(1, _read, str(out / "dp_reshardable"), "transformer_engine")[0]
    assert errors and all("does not match the checkpoint's weights" in e for e in errors.values()), errors


def test_megatron_core_parameter_order():
    from megazero.model import GPTModel
    from megazero.model.interop.megatron_dist import mcore_entries
    from megazero.checkpoint.torch_dist_buckets import megatron_order, module_path
    from tests.mcore import mcore_parameter_names

    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16,
                max_position_embeddings=16, make_vocab_size_divisible_by=32, hidden_dropout=0.0,
                attention_dropout=0.0)
    configs = [
        GPTConfig(**base, activation="gelu", normalization="layernorm", position_embedding_type="learned",
                  add_bias_linear=True, qk_layernorm=True, num_query_groups=2),
        GPTConfig(**base, activation="swiglu", normalization="rmsnorm", position_embedding_type="rope",
                  add_bias_linear=False, tie_embeddings=False, num_experts=4, moe_router_topk=2,
                  moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
                  moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid", moe_layer_freq=(0, 1)),
        GPTConfig(**base, activation="swiglu", normalization="rmsnorm", position_embedding_type="rope",
                  add_bias_linear=False, tie_embeddings=False, multi_latent_attention=True, q_lora_rank=16,
                  kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8),
    ]
    for config, theirs in zip(configs, mcore_parameter_names(configs)):
        params = {n for n, _ in GPTModel(config, device="meta").named_parameters()}
        ours = sorted((module_path(e, "local", False, True) for e in mcore_entries(config, transformer_impl="local")
                       if e.name in params), key=megatron_order)
        assert [".".join(p) for p in ours] == theirs


def test_no_load_optim_reads_the_weights_and_the_schedule_starts_afresh(dense):
    out, ref = dense
    got = launch(1, FLAGS + ["--load", str(out / "fully_reshardable"), "--no-load-optim"], out, "no_optim")
    assert sorted(got) == [3, 4]
    assert abs(got[3]["lm_loss"] - ref[3]["lm_loss"]) <= RTOL * ref[3]["lm_loss"]  # the same weights
    # a fresh Adam at the schedule's step 0 (the log gives the lr after the step: at sample 8, the warmup's end)
    assert abs(got[4]["lm_loss"] - ref[4]["lm_loss"]) > 10 * RTOL * ref[4]["lm_loss"], (got[4], ref[4])
    assert got[3]["lr"] == pytest.approx(2e-2, rel=1e-12), got[3]["lr"]
    log = open(out / "no_optim.log").read()
    assert "weights only" in log and "LR schedule is this run's own from its step 0" in log, log[-2000:]


def test_what_cannot_resume_is_refused_with_the_way_out(dense):
    from tests.launch import in_pool

    out, _ = dense
    elsewhere = in_pool(2, FLAGS + ["--tp", "2", "--load", str(out / "dp_reshardable")], cwd=out)
    assert elsewhere.returncode != 0 and "only at the layout that saved it (--tp 1 --pp 1" in elsewhere.output \
        and "--no-load-optim" in elsewhere.output, elsewhere.output[-2000:]
    changed = in_pool(1, FLAGS + ["--lr", "1e-3", "--load", str(out / "dp_reshardable")], cwd=out)
    assert changed.returncode != 0 and "--use-checkpoint-opt_param-scheduler" in changed.output, changed.output[-2000:]
