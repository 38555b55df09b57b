"""Model-state bytes per rank against the ZeRO paper's formulas, and ZeRO-3 traffic against theory."""

import pytest
import torch

from megazero import mpu, zero
from megazero.model import GPTModel
from tests.distributed import run_distributed
from tests.zero.common import SEED, batches, ds_config, tiny_config

BIG = dict(hidden_size=64, num_attention_heads=4, num_layers=2)


def _state_bytes(stage, precision):
    mpu.initialize_model_parallel(2)
    torch.manual_seed(SEED)
    extra = {"bf16": {"enabled": True}} if precision == "bf16" else {}
    engine = zero.initialize(GPTModel(tiny_config(**BIG)), ds_config(stage, **extra), mpu=mpu)
    rows = batches(1, 1, 4)[0, 0][mpu.get_data_parallel_rank() * 2:][:2]
    engine.backward(engine(rows[:, :-1], labels=rows[:, 1:]).mean())
    engine.step()  # Adam moments exist after the first step
    return engine.model_state_bytes(), engine.num_local_parameters(), mpu.get_data_parallel_world_size()


# bytes per parameter: (params, grads, optimizer) as functions of dp; fp32 master aliases the params.
# bf16 gradients are accumulated in fp32 (Megatron's main_grad): 2 + 4 + 12 = 18 bytes at stage 0,
# Megatron's distributed-optimizer figure.
FORMULAS = {
    ("bf16", 0): lambda n: (2, 4, 12), ("bf16", 1): lambda n: (2, 4, 12 / n),
    ("bf16", 2): lambda n: (2, 4 / n, 12 / n), ("bf16", 3): lambda n: (2 / n, 4 / n, 12 / n),
    ("fp32", 0): lambda n: (4, 4, 8), ("fp32", 1): lambda n: (4, 4, 8 / n),
    ("fp32", 2): lambda n: (4, 4 / n, 8 / n), ("fp32", 3): lambda n: (4 / n, 4 / n, 8 / n),
}


@pytest.mark.parametrize("precision", ["bf16", "fp32"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_model_state_bytes_match_zero_formula(stage, precision):
    for got, psi, dp in run_distributed(4, _state_bytes, stage, precision):
        per_param = FORMULAS[(precision, stage)](dp)
        for key, k in zip(("params", "grads", "optimizer"), per_param):
            expected = k * psi
            assert abs(got[key] - expected) <= 0.05 * expected, (key, got[key], expected)
        # the headline: (2+2+12)·Ψ/(tp·dp) for mixed-precision ZeRO-3, Ψ here being the TP shard
        assert abs(got["total"] - sum(per_param) * psi) <= 0.05 * sum(per_param) * psi


def _traffic(recompute=None, comm_dtype=None):
    mpu.initialize_model_parallel(2)
    torch.manual_seed(SEED)
    model = GPTModel(tiny_config(**BIG, recompute_granularity=recompute))
    extra = {"communication_data_type": comm_dtype} if comm_dtype else {}
    engine = zero.initialize(model, ds_config(3, bf16={"enabled": True}, **extra), mpu=mpu)
    rows = batches(1, 1, 4)[0, 0][mpu.get_data_parallel_rank() * 2:][:2]
    shapes = []
    engine.module.embedding.weight.register_hook(lambda g: shapes.append(tuple(g.shape)))
    engine.comm.reset()
    engine.backward(engine(rows[:, :-1], labels=rows[:, 1:]).mean())
    engine.step()
    local = engine.num_local_parameters()
    parts = (engine.module.embedding.weight.numel(), engine.module.position_embeddings.weight.numel())
    return engine.comm.snapshot(), local, shapes, tuple(engine.module.embedding.weight.ds_shape), parts


@pytest.mark.parametrize("recompute,comm_dtype", [(None, None), ("full", None), (None, "bf16")])
def test_zero3_traffic_matches_theory_and_no_full_vocab_grad(recompute, comm_dtype):
    # With full recompute every layer runs forward twice, yet it must be gathered only
    # twice per step: recomputation happens while backward holds it.
    for snap, psi, shapes, emb_shape, (emb, pos) in run_distributed(4, _traffic, recompute, comm_dtype):
        # Forward and backward each gather every parameter of the TP shard once (bf16: 2 bytes), with
        # two exceptions that follow from gathering only what is used: the tied word embedding is
        # gathered again for the output layer, and lookup tables (word and position embeddings) are
        # not gathered in backward, whose gradient needs only the token ids. So 2Ψ + emb - pos.
        gathered = 2 * psi + emb - pos
        assert abs(snap["all_gather/dp"] - 2 * gathered) <= 0.02 * 2 * gathered, (snap, psi, emb, pos)
        # Backward reduce-scatters every gradient once, in fp32 unless communication_data_type says bf16.
        width = 2 if comm_dtype == "bf16" else 4
        assert abs(snap["reduce_scatter/dp"] - width * psi) <= 0.05 * width * psi, (snap, psi)
        assert "all_reduce/tp" not in snap and snap.get("all_reduce/dp", 0) < 64
        # The vocab-parallel embedding's gradient is only ever this rank's vocabulary shard.
        assert shapes == [emb_shape] and emb_shape[0] == 128 // 2
