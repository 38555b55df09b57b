"""The closed-form counts (megazero.model.flops) and the planner (megazero.observe.planner) of multi-latent
attention and multi-token prediction: parameters against built models, FLOPs against torch's counter,
DeepSeek-V3-671B's published figures, and the per-stage plan of a pipelined launch."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megazero.model import GPTModel
from megazero.model.config import GPTConfig
from megazero.model.flops import (active_parameters, expert_parameters, flops_per_iteration, mtp_parameters,
                                  num_parameters, replicated_parameters)
from tests.distributed import run_distributed
from tests.model.common import tiny_config

MOE = dict(num_experts=4, moe_ffn_hidden_size=32, moe_router_topk=2, moe_layer_freq=(0, 1),
           moe_shared_expert_intermediate_size=16)
# Tiny multi-latent configs: with and without the query latent, dense and mixture, MTP of 0 and 2 depths,
# tied and untied, with biases (layernorm) and without (RMSNorm).
CONFIGS = {
    "q lora": dict(q_lora_rank=24),
    "no q lora": dict(q_lora_rank=None),
    "q lora moe mtp2 untied": dict(q_lora_rank=24, mtp_num_layers=2, **MOE),
    "no q lora moe mtp1 tied": dict(q_lora_rank=None, mtp_num_layers=1, tie_embeddings=True, **MOE),
    "biases layernorm mtp1": dict(q_lora_rank=24, mtp_num_layers=1, add_bias_linear=True, normalization="layernorm"),
}


def _mla(**overrides) -> GPTConfig:
    mla = dict(num_attention_heads=4, num_query_groups=None, multi_latent_attention=True, kv_lora_rank=16,
               qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="rope", attention_backend="math")
    return tiny_config("llama", **{**mla, **overrides})


def deepseek_v3(**overrides) -> GPTConfig:
    """DeepSeek-V3-671B's published shape (its config.json), one MTP depth."""
    shape = dict(num_layers=61, hidden_size=7168, num_attention_heads=128, ffn_hidden_size=18432, vocab_size=129280,
                 make_vocab_size_divisible_by=1, seq_length=4096, max_position_embeddings=4096,
                 position_embedding_type="rope", normalization="rmsnorm", activation="swiglu", add_bias_linear=False,
                 tie_embeddings=False, multi_latent_attention=True, q_lora_rank=1536, kv_lora_rank=512,
                 qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, num_experts=256, moe_ffn_hidden_size=2048,
                 moe_layer_freq=tuple([0] * 3 + [1] * 58), moe_shared_expert_intermediate_size=2048,
                 moe_router_topk=8, mtp_num_layers=1)
    return GPTConfig(**{**shape, **overrides})


@pytest.mark.parametrize("name", CONFIGS)
def test_the_closed_form_counts_the_parameters_of_the_built_model(name):
    c = _mla(**CONFIGS[name])
    model = GPTModel(c, device="meta")
    assert num_parameters(c) == num_parameters(model)
    # tensor parallelism replicates exactly the parameters it does not mark as sharded
    assert replicated_parameters(c) == sum(p.numel() for p in model.parameters()
                                           if not getattr(p, "tensor_model_parallel", False))
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert experts == expert_parameters(c)
    mtp = sum(p.numel() for p in model.mtp.parameters()) if model.mtp is not None else 0
    mtp_replicated = sum(p.numel() for p in model.mtp.parameters() if not getattr(p, "tensor_model_parallel", False)) \
        if model.mtp is not None else 0
    assert mtp_parameters(c)[:2] == (mtp, mtp_replicated)


def test_a_last_stage_holds_mtp_and_an_embedding_copy_counted_once():
    """pp 2, untied: the last stage builds the MTP depths and a copy of the word embedding (marked as
    the first stage's); the stages' parameters less the copy are the closed form's."""
    c = _mla(q_lora_rank=24, mtp_num_layers=2, num_layers=3, **{**MOE, "moe_layer_freq": (0, 1, 1)})
    first = GPTModel(c, device="meta", pre_process=True, post_process=False, layers=range(0, 1))
    last = GPTModel(c, device="meta", pre_process=False, post_process=True, layers=range(1, 3))
    assert last.embedding is not None and last.embedding.weight.pipeline_shared_copy
    copy = last.embedding.weight.numel()
    assert num_parameters(first) + num_parameters(last) - copy == num_parameters(c)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_closed_form_flops_are_torchs_count_of_the_forward(name):
    """One training forward (the MTP depths run with labels) under torch's FLOP counter: the matmuls and
    the s x s attention of every layer, the depths and the logits are a third of flops_per_iteration."""
    c = _mla(**CONFIGS[name])
    torch.manual_seed(0)
    model = GPTModel(c)
    model.train()
    ids = torch.randint(0, c.vocab_size, (1, c.seq_length))
    with FlopCounterMode(display=False) as counter:
        model(ids, labels=ids)
    assert counter.get_total_flops() == flops_per_iteration(c, 1) / 3


def _tp2_replicated(overrides: dict) -> tuple[int, int]:
    from megazero import mpu

    groups = mpu.initialize_model_parallel(2)
    c = _mla(**overrides)
    m = GPTModel(c, tp_group=groups.tp_group, device="meta")
    local = num_parameters(m, local=True)
    replicated = sum(p.numel() for p in m.parameters() if not getattr(p, "tensor_model_parallel", False))
    mpu.destroy_model_parallel()
    return local, replicated


def test_at_tp2_the_up_projections_are_sharded_and_the_down_projections_replicated():
    overrides = CONFIGS["q lora moe mtp2 untied"]
    c = _mla(**overrides)
    local, replicated = run_distributed(2, _tp2_replicated, overrides)[0]
    assert replicated == replicated_parameters(c)
    assert local == (num_parameters(c) - replicated) // 2 + replicated


def test_deepseek_v3_is_671b_with_37b_activated_and_an_mtp_module_of_11_6b():
    """DeepSeek-V3's report: 671B total, 37B activated per token; the Hugging Face checkpoint's 685B add
    the MTP module (its layer 61: 11.6B of its own, and copies of the embedding and the head, 1.85B)."""
    c = deepseek_v3()
    mtp = mtp_parameters(c)[0]
    main = num_parameters(c) - mtp
    assert main == 671_026_404_352
    assert mtp == 11_610_067_968
    assert round((main + mtp + 2 * 129280 * 7168) / 1e9, 1) == 684.5
    assert active_parameters(c.replace(mtp_num_layers=0)) == 37_552_282_624
    assert expert_parameters(c) == 59 * 256 * 3 * 7168 * 2048  # 58 layers' and the MTP layer's routed experts


def test_the_plan_holds_per_rank_what_the_tp2_model_holds():
    """tools/estimate_memory.py's per-GPU parameters at tp 2: the up-projections halved, the down-projections,
    their norms and the MTP depths' norms whole."""
    from megazero.observe.planner import estimate_memory

    overrides = CONFIGS["q lora moe mtp2 untied"]
    local, _ = run_distributed(2, _tp2_replicated, overrides)[0]
    est = estimate_memory(_mla(**overrides), tp=2, dp=1, zero_stage=0, micro_batch_size=1)
    assert est.params_per_rank == local


@pytest.mark.parametrize("tied", [False, True])
def test_each_pipeline_stage_of_the_plan_holds_what_the_stage_builds(tied):
    """pp 2 (the first stage one dense layer, the last two mixtures and the MTP depths): the plan's
    parameters per stage are the built stages' (the last one's embedding copy included)."""
    from megazero.observe.planner import estimate_memory

    c = _mla(q_lora_rank=24, mtp_num_layers=2, num_layers=3, tie_embeddings=tied, **{**MOE, "moe_layer_freq": (0, 1, 1)})
    built = [GPTModel(c, device="meta", pre_process=True, post_process=False, layers=range(0, 1)),
             GPTModel(c, device="meta", pre_process=False, post_process=True, layers=range(1, 3))]
    est = estimate_memory(c, tp=1, dp=1, pp=2, zero_stage=0, micro_batch_size=1, first_stage_layers=1)
    assert [st["params"] for st in est.pipeline["stages"]] == [num_parameters(m) for m in built]
    assert est.pipeline["stages"][1]["ends"] == " + head + 2 MTP"
