"""Hugging Face Kimi Linear <-> megazero, against transformers' own model (fp32, eager attention and experts, its
PyTorch KDA rule and convolution): a tiny random model (three KDA layers and one multi-latent attention layer without
RoPE, a dense MLP then mixtures with an expert bias and a shared expert) over 70 tokens, two chunks of the rule:
the import gives transformers' logits; the export is what transformers loads, weight for weight, and imports back
bit for bit; transformers' in-memory names and the Hub's config.json read the same; what megazero cannot represent
is refused."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Kimi Linear reference is transformers'")

from megazero.model import GPTConfig, GPTModel  # noqa: E402
from megazero.model.interop.hf import config_from_hf, export_to_hf, from_hf_state_dict, hf_architecture, \
    import_from_hf  # noqa: E402
from megazero.model.state_dict import gather_full_state_dict, load_full_state_dict  # noqa: E402

VOCAB, T = 128, 70
REFERENCE = dict(attn_implementation="eager", experts_implementation="eager")
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
             v_head_dim=8, qk_nope_head_dim=8, num_experts=4, num_local_experts=4, num_experts_per_tok=2,
             linear_head_dim=8, linear_num_heads=4, linear_conv_kernel_dim=4, pad_token_id=0, bos_token_id=1,
             eos_token_id=2,  # Kimi Linear's own ids (~163,600) lie beyond a tiny vocabulary
             layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3)


def random_hf(hf_dir=None):
    """transformers' model, every weight moved off its init but A_log and dt_bias (drawn as Kimi Linear's), the
    experts' score correction bias random too."""
    torch.manual_seed(0)
    model = transformers.KimiLinearForCausalLM(transformers.KimiLinearConfig(**SHAPE, **REFERENCE)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    if hf_dir is not None:
        model.save_pretrained(str(hf_dir))
    return model


def ids(batch: int = 2, length: int = T, seed: int = 7):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_import_matches_transformers_and_exports_back_bit_for_bit(tmp_path):
    hf = random_hf(tmp_path / "hf")
    config, full_sd = import_from_hf(str(tmp_path / "hf"), make_vocab_size_divisible_by=48)  # 144 rows: padding
    assert hf_architecture(config) == "kimi_linear" == config.hf_model_type
    assert (config.experimental_attention_variant, config.linear_attention_freq, config.moe_layer_freq) == (
        "kda", 4, (0, 1, 1, 1))
    assert (config.position_embedding_type, config.multi_latent_attention, config.kda_f_lora_rank,
            config.moe_router_topk_scaling_factor, config.moe_router_enable_expert_bias) == (
        "none", True, 8, 2.446, True)
    model = GPTModel(config).eval()
    load_full_state_dict(model, full_sd)
    assert [type(layer.self_attention).__name__ for layer in model.layers] == ["KimiDeltaAttention"] * 3 + [
        "MultiLatentAttention"]
    with torch.no_grad():
        got, want = model(ids())[..., :VOCAB], hf(ids()).logits
    assert (got - want).abs().max() < 1e-4, (got - want).abs().max()
    assert want.abs().max() > 1.0  # logits far from 0: the tolerance means something

    assert export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back")) == "KimiLinearForCausalLM"
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), **REFERENCE).eval()
    before, after = hf.state_dict(), back.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    saved, original = (json.load(open(d / "config.json")) for d in (tmp_path / "back", tmp_path / "hf"))
    for key in ("model_type", "layer_types", "mlp_layer_types", "linear_head_dim", "linear_num_heads", "num_experts",
                "num_experts_per_token", "moe_renormalize", "routed_scaling_factor", "num_shared_experts",
                "qk_rope_head_dim", "kv_lora_rank", "tie_word_embeddings"):
        assert saved.get(key) == original.get(key), key
    again, again_sd = import_from_hf(str(tmp_path / "back"), make_vocab_size_divisible_by=48)
    assert again == config and again_sd.keys() == full_sd.keys()
    assert all(torch.equal(again_sd[k], full_sd[k]) for k in full_sd)
    # transformers' in-memory names (the forget gate module, one convolution, stacked experts) read the same
    in_memory = from_hf_state_dict(dict(hf.state_dict()), config)
    assert all(torch.equal(in_memory[k], full_sd[k]) for k in full_sd) and in_memory.keys() == full_sd.keys()


def test_the_hubs_config_reads_as_transformers_does():
    """The Hub's config.json (``linear_attn_config`` with 1-based layer lists, ``first_k_dense_replace``, its own
    names of the routing fields) gives the config transformers' names give."""
    ours = config_from_hf(random_hf().config.to_dict())
    hub = {"model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": VOCAB,
           "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": 4,
           "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
           "qk_rope_head_dim": 8, "v_head_dim": 8, "qk_nope_head_dim": 8, "mla_use_nope": True, "num_experts": 4,
           "num_experts_per_token": 2, "moe_renormalize": True, "moe_router_activation_func": "sigmoid",
           "num_expert_group": 1, "topk_group": 1, "num_shared_experts": 1, "routed_scaling_factor": 2.446,
           "first_k_dense_replace": 1, "moe_layer_freq": 1, "model_max_length": 1048576, "rms_norm_eps": 1e-5,
           "hidden_act": "silu", "tie_word_embeddings": False,
           "linear_attn_config": {"kda_layers": [1, 2, 3], "full_attn_layers": [4], "head_dim": 8, "num_heads": 4,
                                  "short_conv_kernel_size": 4}}
    assert config_from_hf(hub) == ours


def _kda_gpt(**kw) -> GPTConfig:
    fields = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16,
                  max_position_embeddings=16, normalization="rmsnorm", activation="swiglu", add_bias_linear=False,
                  position_embedding_type="none", multi_latent_attention=True, kv_lora_rank=16, qk_head_dim=8,
                  qk_pos_emb_head_dim=8, v_head_dim=8, latent_layernorm_epsilon=1e-6,
                  experimental_attention_variant="kda", linear_attention_freq=2, linear_num_key_heads=4,
                  linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, kda_f_lora_rank=8,
                  kda_gate_lora_rank=8)
    return GPTConfig(**{**fields, **kw}).validate()


@pytest.mark.parametrize("change, message", [
    (dict(multi_latent_attention=False, position_embedding_type="rope"), "multi_latent_attention=False (Kimi Linear "
     "needs True)"),
    (dict(position_embedding_type="rope"), "position_embedding_type='rope' (Kimi Linear needs 'none')"),
    (dict(kda_f_lora_rank=None), "kda_f_lora_rank=None (Kimi Linear's KDA has linear_head_dim everywhere: needs 8)"),
])
def test_what_kimi_linear_cannot_hold_is_refused(change, message):
    assert hf_architecture(_kda_gpt()) == "kimi_linear"
    with pytest.raises(ValueError, match="only Kimi Linear") as e:
        hf_architecture(_kda_gpt(**change))
    assert message in str(e.value), str(e.value)


def test_a_config_megazero_cannot_build_is_refused_by_value():
    hf = random_hf().config.to_dict()
    with pytest.raises(ValueError, match=r"mla_use_nope=False .*needs True"):
        config_from_hf({**hf, "mla_use_nope": False})
    with pytest.raises(ValueError, match="num_key_value_heads=2"):
        config_from_hf({**hf, "num_key_value_heads": 2})
