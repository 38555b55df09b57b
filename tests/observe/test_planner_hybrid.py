"""The planner on hybrid stacks (Gated DeltaNet, KDA, Mamba-2, attention, MLP and MoE layers): the recurrent layers'
context-parallel bytes (state summaries and the convolution's halo, independent of the sequence), their
activations against what autograd saves, and every figure against the rehearsal of the launch (tools/rehearse.py):
the model state to the byte, the bytes sent per group, the peak."""

from __future__ import annotations

import pytest
import torch

from megazero.model.config import GPTConfig
from megazero.observe.planner import estimate_memory
from megazero.observe.planner_recurrent import recurrent_activation_bytes, recurrent_cp_bytes_per_layer
from megazero.observe.planner_traffic import cp_bytes_per_layer
from megazero.observe.rehearsal import PLAN_GROUPS, rehearsal_config, rehearse_rank, sent_by_plan_group

K, M = 1024, 1024 * 1024


def hybrid(pattern: str, **kw) -> GPTConfig:
    """Hidden 512; Gated DeltaNet 4 key heads to 8 value heads of 64; Mamba-2 16 heads of 64, 4 groups of state 64."""
    moe = dict(num_experts=4, moe_router_topk=2) if "E" in pattern else {}
    base = dict(num_layers=len(pattern.replace("|", "")), hidden_size=512, num_attention_heads=8, num_query_groups=4,
                vocab_size=1024, seq_length=4096, max_position_embeddings=4096, position_embedding_type="rope",
                normalization="rmsnorm", activation="swiglu", add_bias_linear=False, hidden_dropout=0.0,
                attention_dropout=0.0, attention_backend="flash", hybrid_layer_pattern=pattern,
                linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
                mamba_num_heads=16, mamba_head_dim=64, mamba_num_groups=4, mamba_state_dim=64, **moe)
    return GPTConfig(**{**base, **kw})


def _cp(config: GPTConfig, seq: int, **kw) -> float:
    plan = dict(tp=1, dp=1, zero_stage=1, micro_batch_size=1, seq_length=seq, context_parallel=4, flash_attn=True)
    return estimate_memory(config.replace(seq_length=seq, max_position_embeddings=seq), **{**plan, **kw}).traffic["cp"]


def test_the_recurrent_exchange_is_the_summaries_and_the_halo():
    """Per layer and micro-batch at cp 4, bf16: 2 runs a rank, each an fp32 summary (the state and its transition)
    and K-1 = 3 halo tokens of the convolution's channels, sent to 3 ranks in forward and reduce-scattered back."""
    c = hybrid("GM")
    kw = dict(tp=1, cp=4, seq_length=128 * K, micro_batch_size=1, precision="bf16", recompute=None)
    gdn = 2 * (4 * (8 * 64 * 64 + 8 * 64 * 64) + 3 * (2 * 4 * 64 + 8 * 64) * 2) * 3
    mamba = 2 * (4 * (16 * 64 * 64 + 16) + 3 * (16 * 64 + 2 * 4 * 64) * 2) * 3
    assert recurrent_cp_bytes_per_layer(c, "gdn", **kw) == 2 * gdn
    assert recurrent_cp_bytes_per_layer(c, "mamba", **kw) == 2 * mamba
    kda = c.replace(linear_num_value_heads=4)  # 4 heads of 64: the state and transition of GDN's 8, half the halo
    assert recurrent_cp_bytes_per_layer(kda, "kda", **kw) == 2 * 2 * (4 * (4 * 64 * 64 * 2) + 3 * (3 * 4 * 64) * 2) * 3
    assert recurrent_cp_bytes_per_layer(c, "gdn", **{**kw, "recompute": "full"}) == 3 * gdn  # forward again
    assert recurrent_cp_bytes_per_layer(c, "gdn", **{**kw, "tp": 2}) == gdn  # half the heads and channels
    # Megatron's heads all-to-all: q, k, v, beta, a (x, dt, B, C) out and the output back, (P-1)/P of the rank's
    # tokens
    a2a = c.replace(linear_cp_comm_type="a2a")
    tokens = 2 * 2 * (32 * K) * 3 / 4  # bf16, out and back
    assert recurrent_cp_bytes_per_layer(a2a, "gdn", **kw) == tokens * (2 * 4 * 64 + 2 * 8 * 64 + 2 * 8)
    assert recurrent_cp_bytes_per_layer(a2a, "mamba", **kw) == tokens * (2 * 16 * 64 + 16 + 2 * 4 * 64)


@pytest.mark.parametrize("pattern", ["GM-E", "GGG*E", "M-M*-M-"])
def test_cp_bytes_of_the_recurrent_layers_do_not_grow_with_the_sequence(pattern):
    """At cp 4 the plan's context-parallel bytes at 128K and 1M tokens differ by the attention layers' alone
    (their ring's K/V grow with the sequence); without attention they are equal."""
    c = hybrid(pattern)
    attention = sum(c.layer_kinds(i).mixer == "standard" for i in range(c.num_layers))
    ring = dict(tp=1, cp=4, micro_batch_size=1, precision="bf16", recompute=None, kind="p2p")
    grows = attention * (cp_bytes_per_layer(c, seq_length=M, **ring)
                         - cp_bytes_per_layer(c, seq_length=128 * K, **ring))
    assert _cp(c, M) - _cp(c, 128 * K) == pytest.approx(grows, rel=1e-12)
    assert (grows == 0) == (attention == 0)


def _saved(module: torch.nn.Module, x: torch.Tensor) -> int:
    seen: dict[int, int] = {}
    skip = {p.untyped_storage().data_ptr() for p in module.parameters()} | {x.untyped_storage().data_ptr()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


@pytest.mark.parametrize("kind", ["gdn", "kda", "mamba"])
def test_recurrent_activations_are_what_autograd_saves(kind):
    """The planner's bytes of a bf16 mixer (not its input) against the storages its forward saves, within 5 %."""
    from megazero.model.recurrent.gated_delta_net import GatedDeltaNet
    from megazero.model.recurrent.kimi_delta_attention import KimiDeltaAttention
    from megazero.model.recurrent.mamba import MambaMixer

    sizes = dict(hidden_size=256, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=48,
                 linear_value_head_dim=32, mamba_num_heads=12, mamba_head_dim=32, mamba_num_groups=3,
                 mamba_state_dim=32, params_dtype=torch.bfloat16)
    if kind == "kda":  # Kimi Linear's: as many value heads as key heads, low-rank gates
        c = hybrid("*", **{**sizes, "linear_num_value_heads": 2, "kda_f_lora_rank": 16}).replace(
            hybrid_layer_pattern=None, num_layers=2, experimental_attention_variant="kda", linear_attention_freq=2)
    else:
        c = hybrid("G" if kind == "gdn" else "M", **sizes)
    layer = {"gdn": GatedDeltaNet, "kda": KimiDeltaAttention, "mamba": MambaMixer}[kind](c, tp_group=None, tp_size=1)
    s, b = 512, 2
    saved = _saved(layer, torch.randn(s, b, 256, dtype=torch.bfloat16, requires_grad=True))
    assert recurrent_activation_bytes(c, kind, micro_batch_size=b, seq_length=s) == pytest.approx(saved, rel=0.05)


SMALL = ["--hidden-size", "512", "--num-attention-heads", "8", "--num-query-groups", "4", "--micro-batch-size", "1",
         "--bf16", "--vocab-size", "1024", "--tokenizer-type", "NullTokenizer", "--attention-backend", "flash",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--swiglu", "--disable-bias-linear",
         "--position-embedding-type", "rope", "--linear-num-key-heads", "4", "--linear-num-value-heads", "8",
         "--linear-key-head-dim", "64", "--linear-value-head-dim", "64", "--mamba-num-heads", "16",
         "--mamba-head-dim", "64", "--mamba-num-groups", "4", "--mamba-state-dim", "64", "--global-batch-size"]


KDA = ["--num-layers", "2", "--experimental-attention-variant", "kda", "--linear-attention-freq", "2",
       "--linear-num-value-heads", "4", "--kda-f-lora-rank", "64"]  # Kimi Linear's: layer 0 KDA, layer 1 attention


def _flags(pattern: str, seq: int, *rest: str) -> list[str]:
    moe = ["--num-experts", "4", "--moe-router-topk", "2"] if "E" in pattern else []
    layers = KDA if pattern == "kda" else ["--hybrid-layer-pattern", pattern]
    return SMALL + ["2" if "--pp" in rest else "1", *layers, "--seq-length", str(seq),
                    "--max-position-embeddings", str(seq), *moe, *rest]


# (ranks, pattern, sequence, flags): the rank rehearsed is the last (at cp: the one whose runs both follow another)
LAYOUTS = {
    "cp4": (4, "G*M-", 8 * K, ["--cp", "4"]),
    "cp4 heads all-to-all": (4, "G*M-", 8 * K, ["--cp", "4", "--linear-cp-comm-type", "a2a"]),
    "cp4 full recompute": (4, "G*M-", 8 * K, ["--cp", "4", "--recompute-granularity", "full"]),
    "tp2": (2, "GM*E", 2 * K, ["--tp", "2"]),
    "tp2 sp": (2, "GG*E", 2 * K, ["--tp", "2", "--sequence-parallel"]),
    "pp2 cut": (2, "GM*-|G-ME", 2 * K, ["--pp", "2"]),
    "kda cp4": (4, "kda", 8 * K, ["--cp", "4"]),
    "kda tp2": (2, "kda", 2 * K, ["--tp", "2"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_plan_is_the_rehearsal(layout):
    """Model state to the byte; bytes sent per group within 2 % (tensor parallel 10 %: the embedding's and the
    loss's exchanges are not planned; context parallel exact); the peak within 10 %."""
    world, pattern, seq, rest = LAYOUTS[layout]
    config, _ = rehearsal_config(_flags(pattern, seq, *rest), world)
    for rank in ([0, world - 1] if "--pp" in rest else [world - 1]):
        r = rehearse_rank(config, rank)
        assert r.engine_state_bytes == r.plan["state_bytes"], (rank, r.engine_state_bytes, r.plan)
        assert r.plan["peak_bytes"] == pytest.approx(r.peak_bytes, rel=0.10), (rank, r.plan, r.peak_bytes)
        sent = sent_by_plan_group(r)
        for key in PLAN_GROUPS:
            rel = {"tp": 0.10, "cp": 0.0}.get(key, 0.02)
            assert sent[key] == pytest.approx(r.plan[f"sent_{key}"], rel=rel, abs=64), (rank, key, sent, r.plan)


def test_the_rehearsal_sends_as_much_at_1m_tokens_as_at_128k():
    """Mamba-2 and Gated DeltaNet mixers at cp 4: the busiest rank sends the same context-parallel bytes at 128K
    and at 1M tokens, and they are the plan's."""
    sent = []
    for seq in (128 * K, M):
        config, _ = rehearsal_config(_flags("GM--", seq, "--cp", "4"), 4)
        r = rehearse_rank(config, 3)
        assert sent_by_plan_group(r)["cp"] == r.plan["sent_cp"]
        sent.append(r.plan["sent_cp"])
    assert sent[0] == sent[1] > 0


def test_the_step_time_of_a_hybrid_stack_counts_each_layer_by_kind():
    """tools/plan.py's step-time model times each kind of layer apart: a Mamba-2 stack's compute grows with the
    sequence like its tokens (no square term), an attention stack's faster; a pipeline stage is timed by the
    layers it holds."""
    from tests.observe.test_plan import _model

    from megazero.observe.plan_devices import Cluster, device_preset
    from megazero.observe.plan_search import evaluate
    from megazero.observe.plan_time import Layout

    cluster = Cluster(8, 8, device_preset("h100-80gb"))
    mamba = ("--hybrid-layer-pattern", "M-M-M-M-", "--mamba-num-heads", "32", "--mamba-head-dim", "64",
             "--mamba-num-groups", "8", "--mamba-state-dim", "128", "--position-embedding-type", "none")
    lay = Layout(tp=1, pp=1, dp=8, zero_stage=1, micro_batch_size=1)

    def compute(seq: int, *extra: str) -> float:
        _, config, base = _model(8, 16, 1024, seq, 8, *extra)
        return evaluate(config.model, lay, cluster, base, global_batch_size=8, precision="bf16",
                        optimizer="adamw").time.terms["compute"]

    recurrent = compute(32768, *mamba) / compute(8192, *mamba)
    attention = compute(32768) / compute(8192)
    assert 3.0 < recurrent <= 4.2 and attention > recurrent + 2.0, (recurrent, attention)  # tokens x4
    slowest = []
    for pattern in ("M-M-|*-*-", "*-*-|M-M-"):  # the same layers, the other way round over the two stages
        _, config, base = _model(8, 16, 1024, 8192, 8, "--hybrid-layer-pattern", pattern, *mamba[2:])
        plan = evaluate(config.model, Layout(tp=1, pp=2, dp=4, zero_stage=1, micro_batch_size=1), cluster, base,
                        global_batch_size=8, precision="bf16", optimizer="adamw")
        slowest.append(plan.time.slowest_stage)
    assert slowest in ([0, 1], [1, 0])  # the stage holding the costlier kind, wherever it is
