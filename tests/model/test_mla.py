"""Multi-latent attention: one layer against transformers' DeepseekV3Attention (weights copied by name),
and a GPT with it at tp 2 (with and without sequence parallelism, with keyed dropout) and context-parallel
against one process."""

import pytest
import torch
import torch.distributed as dist

from megazero.model.forward_context import ForwardContext
from megazero import mpu
from megazero.model import GPTModel
from megazero.model.attention.cp.exchanges import SequenceShard
from megazero.model.attention.cp.context import ContextParallel
from megazero.model.attention.cp.layout import zigzag_layout
from megazero.model.attention.mla import MultiLatentAttention
from megazero.model.attention.rope import rotary_embedding
from megazero.model.keyed_dropout import sample_keys
from megazero.model.state_dict import gather_full_state_dict, gather_full_tensor
from tests.distributed import run_distributed
from tests.helpers import assert_close
from tests.model.common import SEQ, batch, mean_loss, tiny_config

H, HEADS, QK, ROPE, V, KV_LORA, Q_LORA = 64, 4, 8, 4, 6, 16, 24  # v != qk + rope, as in DeepSeek
YARN = dict(rope_type="yarn", rotary_scaling_factor=4.0, original_max_position_embeddings=8, beta_fast=32.0,
            beta_slow=1.0, mscale=0.707, mscale_all_dim=1.0)


def _config(q_lora: bool, yarn: bool, **overrides):
    mla = dict(num_attention_heads=HEADS, num_query_groups=None, multi_latent_attention=True,
               q_lora_rank=Q_LORA if q_lora else None, kv_lora_rank=KV_LORA, qk_head_dim=QK,
               qk_pos_emb_head_dim=ROPE, v_head_dim=V, layernorm_epsilon=1e-6, attention_backend="sdpa")
    return tiny_config("llama", **mla, **(YARN if yarn else dict(rope_type="rope")), **overrides)


# megazero's names -> transformers' DeepseekV3Attention's
HF_NAMES = {"linear_q_proj": "q_proj", "linear_q_down_proj": "q_a_proj", "q_layernorm": "q_a_layernorm",
            "linear_q_up_proj": "q_b_proj", "linear_kv_down_proj": "kv_a_proj_with_mqa",
            "kv_layernorm": "kv_a_layernorm", "linear_kv_up_proj": "kv_b_proj", "linear_proj": "o_proj"}


def _hf_attention(config):
    transformers = pytest.importorskip("transformers")
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

    rope = ({"rope_type": "default", "rope_theta": config.rotary_base} if config.resolved_rope_type == "rope" else
            dict(rope_type="yarn", rope_theta=config.rotary_base, factor=config.rotary_scaling_factor,
                 original_max_position_embeddings=config.original_max_position_embeddings,
                 beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
                 mscale_all_dim=config.mscale_all_dim))
    cfg = transformers.DeepseekV3Config(hidden_size=H, num_attention_heads=HEADS, num_key_value_heads=HEADS,
                                        q_lora_rank=config.q_lora_rank, kv_lora_rank=KV_LORA, qk_nope_head_dim=QK,
                                        qk_rope_head_dim=ROPE, v_head_dim=V, max_position_embeddings=64,
                                        rope_parameters=rope, rope_interleave=True, attention_bias=False)
    cfg._attn_implementation = "sdpa"
    return DeepseekV3Attention(cfg, layer_idx=0), DeepseekV3RotaryEmbedding(cfg)


@pytest.mark.parametrize("yarn", [False, True])
@pytest.mark.parametrize("q_lora", [False, True])
def test_one_layer_equals_transformers_deepseek_v3_attention(q_lora, yarn):
    config = _config(q_lora, yarn)
    torch.manual_seed(0)
    ours = MultiLatentAttention(config, tp_group=mpu.NO_GROUP, tp_size=1)
    hf, hf_rotary = _hf_attention(config)
    with torch.no_grad():
        for name, p in ours.named_parameters():
            p.normal_(1.0 if "layernorm" in name else 0.0, 0.3)  # the norms' weights not all ones
        theirs = dict(hf.named_parameters())
        assert len(theirs) == len(list(ours.parameters()))
        for name, p in ours.named_parameters():
            module, leaf = name.rsplit(".", 1)
            assert theirs[f"{HF_NAMES[module]}.{leaf}"].shape == p.shape, name
            theirs[f"{HF_NAMES[module]}.{leaf}"].copy_(p)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SEQ, 2, H, generator=g, requires_grad=True)
    positions = torch.stack([torch.arange(SEQ), torch.arange(SEQ) + 5])  # [b, s]: a second sample offset
    out = ours(x, ForwardContext(rotary_embedding(config)(positions)))  # [s, b, h]
    xb = x.detach().transpose(0, 1).clone().requires_grad_(True)
    ref, _ = hf(xb, hf_rotary(xb, positions), attention_mask=None)  # [b, s, h]
    torch.testing.assert_close(out.transpose(0, 1), ref, rtol=1e-5, atol=1e-5)
    grad = torch.randn(out.shape, generator=g)
    out.backward(grad)
    ref.backward(grad.transpose(0, 1))
    torch.testing.assert_close(x.grad.transpose(0, 1), xb.grad, rtol=1e-5, atol=1e-5)
    # Weight gradients sum every token's products: sdpa's flash kernel (V padded to the q/k width) adds them
    # in another order than the eager reference, which moves a few elements by a few 1e-5.
    for name, p in ours.named_parameters():
        module, leaf = name.rsplit(".", 1)
        torch.testing.assert_close(p.grad, theirs[f"{HF_NAMES[module]}.{leaf}"].grad, rtol=1e-4, atol=1e-4,
                                   msg=lambda m: f"grad of {name}: {m}")


def test_the_softmax_scale_carries_yarns_mscale():
    assert MultiLatentAttention(_config(True, False), tp_group=mpu.NO_GROUP, tp_size=1).q_scale == 1.0
    assert MultiLatentAttention(_config(True, True), tp_group=mpu.NO_GROUP, tp_size=1).q_scale == pytest.approx(
        (0.1 * 1.0 * torch.log(torch.tensor(4.0)).item() + 1.0) ** 2)


SEED = 1234
TP_CASES = [dict(), dict(sequence_parallel=True), dict(sequence_parallel=True, recompute_granularity="selective")]
# dropout keyed by position: the same masks at every layout, so tp 2 must still equal tp 1 (each rank's
# heads keyed by their global index)
DROPOUT = dict(attention_dropout=0.2, hidden_dropout=0.1, dropout_rng="position")


def _run(model, ids, labels):
    keys = sample_keys(SEED, torch.arange(ids.size(0)))
    loss = model(ids, labels=labels, dropout_keys=keys)
    mean_loss(loss, labels).backward()
    return loss.detach(), {n: gather_full_tensor(p.grad, p, model.tp_group) for n, p in model.named_parameters()}


def _tensor_parallel(q_lora: bool):
    config = _config(q_lora, True, **DROPOUT)
    ids, labels = batch(config)
    torch.manual_seed(SEED)
    ref = GPTModel(config)  # before any group exists: one process at tp 1
    ref_weights = gather_full_state_dict(ref)
    ref_loss, ref_grads = _run(ref, ids, labels)
    mpu.initialize_model_parallel(dist.get_world_size())
    worst = 0.0
    for case in TP_CASES:
        torch.manual_seed(SEED)
        model = GPTModel(config.replace(**case))
        assert model.tp_size == 2
        weights = gather_full_state_dict(model)
        assert weights.keys() == ref_weights.keys()
        for k, w in weights.items():
            assert_close(w, ref_weights[k], f"init of {k}", atol=0, rtol=0)
        loss, grads = _run(model, ids, labels)
        worst = max(worst, assert_close(loss, ref_loss, f"loss {case}"))
        for k, g in grads.items():
            worst = max(worst, assert_close(g, ref_grads[k], f"grad of {k} {case}"))
        attn = model.layers[0].self_attention
        down = attn.linear_kv_down_proj.weight
        assert getattr(down, "sequence_parallel", False) == bool(case.get("sequence_parallel"))
        assert not getattr(down, "tensor_model_parallel", False)
    return worst


@pytest.mark.parametrize("q_lora", [False, True])
def test_a_gpt_at_tp2_with_and_without_sequence_parallelism_equals_tp1(q_lora):
    assert max(run_distributed(2, _tensor_parallel, q_lora)) < 1e-5


def _one_process():
    torch.manual_seed(0)
    model = GPTModel(_config(True, True, seq_length=2 * SEQ, max_position_embeddings=2 * SEQ))
    ids, labels = batch(model.config, seq=2 * SEQ)
    loss = model(ids, torch.arange(2 * SEQ), labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _context_parallel(comm_type: str):
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPTModel(_config(True, True, seq_length=2 * SEQ, max_position_embeddings=2 * SEQ))
    ids, labels = batch(model.config, seq=2 * SEQ)
    layout = zigzag_layout(2 * SEQ, cp)
    pos = layout.positions(rank)
    if comm_type == "p2p":
        ctx = ContextParallel.from_layout(layout, rank, None, "p2p")
    else:
        shard = SequenceShard.from_rank_positions([layout.positions(r) for r in range(cp)], rank)
        ctx = ContextParallel(group=None, comm_type=comm_type, shard=shard)
    loss = model(ids[:, pos], pos, labels=labels[:, pos], context_parallel=ctx)
    loss.sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)  # the reduction over context parallel ranks
        grads[n] = p.grad
    return pos, loss.detach(), grads


@pytest.mark.parametrize("comm_type", ["p2p", "a2a", "allgather"])
def test_a_context_parallel_gpt_with_mla_equals_one_process(comm_type):
    ref_loss, ref_grads = _one_process()
    for pos, loss, grads in run_distributed(2, _context_parallel, comm_type):
        torch.testing.assert_close(loss, ref_loss[:, pos], rtol=1e-5, atol=1e-6)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=2e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_zero3_from_meta_at_tp2_dp2_with_sequence_parallelism_trains_as_one_process():
    """Partitioned materialization draws the replicated down-projections as the whole model does, and the
    engine reduces their sequence-parallel gradients: three AdamW steps equal one process's."""
    from tests.zero.common import reference_run, zero_run

    mla = dict(position_embedding_type="rope", normalization="rmsnorm", add_bias_linear=False,
               multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8, qk_head_dim=4, qk_pos_emb_head_dim=4,
               v_head_dim=6, rotary_scaling_factor=4.0, original_max_position_embeddings=4, mscale=0.707,
               mscale_all_dim=1.0)
    ref_losses, _, ref_weights = reference_run(3, model_overrides=mla)
    out = run_distributed(4, zero_run, 2, 3, 3, meta=True, model_overrides={**mla, "sequence_parallel": True})
    losses, _, weights = out[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert weights.keys() == ref_weights.keys()
    for k, w in ref_weights.items():
        torch.testing.assert_close(weights[k], w, rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
