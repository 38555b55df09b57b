"""Hugging Face DeepSeek-V3 <-> megazero: random ``DeepseekV3ForCausalLM`` models (multi-latent attention with
and without query LoRA, YaRN, group-limited sigmoid routing with an expert bias, a shared expert, a dense
first layer) imported give transformers' logits and losses within 1e-4 and export back to the same tensors
bit for bit; a megazero model exports to a directory transformers loads with its logits; the rotate-half
RoPE layout imports as the same function; DeepSeek's multi-token prediction layers map both ways and
compute what DeepSeek's formula does with transformers' layer; what does not convert is refused by value."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from safetensors.torch import load_file, save_file  # noqa: E402

from megazero.model import GPTConfig, GPTModel  # noqa: E402
from megazero.model.interop.hf import config_from_hf, export_to_hf, hf_architecture, import_from_hf  # noqa: E402
from megazero.model.state_dict import gather_full_state_dict, load_full_state_dict  # noqa: E402

VOCAB = 90
YARN = dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, beta_fast=32.0,
            beta_slow=1.0, mscale=1.0, mscale_all_dim=0.8)


def hf_config(**changes) -> "transformers.DeepseekV3Config":
    """A tiny DeepSeek-V3: 8 experts in 4 groups, top 2 of 1 group (k = 2 x topk_group), a dense first layer."""
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1, n_routed_experts=8, n_group=4,
              topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
              qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12, max_position_embeddings=128,
              routed_scaling_factor=2.5, rope_parameters=dict(YARN), tie_word_embeddings=False)
    return transformers.DeepseekV3Config(**{**kw, **changes})


def random_hf(out_dir, **changes):
    """A random DeepSeek-V3 saved to ``out_dir`` (weights and the routers' bias moved off their init)."""
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM(hf_config(**changes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.05)
    model.eval().save_pretrained(str(out_dir))
    return model


def ids_and_labels(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (2, 17), generator=g)
    return ids[:, :-1], ids[:, 1:]


def imported(hf_dir, **overrides) -> tuple[GPTConfig, GPTModel]:
    config, full_sd = import_from_hf(str(hf_dir), make_vocab_size_divisible_by=32, **overrides)
    model = GPTModel(config).eval()
    load_full_state_dict(model, full_sd)
    return config, model


def assert_same_logits_and_loss(model: GPTModel, hf) -> None:
    ids, labels = ids_and_labels()
    with torch.no_grad():
        theirs = hf(ids).logits
        torch.testing.assert_close(model(ids)[..., :VOCAB], theirs, atol=1e-4, rtol=1e-4)
        hf_loss = torch.nn.functional.cross_entropy(theirs.flatten(0, 1), labels.flatten(), reduction="none")
        torch.testing.assert_close(model(ids, labels=labels).flatten(), hf_loss, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "no_q_lora"])
def test_import_matches_transformers_and_exports_back_bit_for_bit(q_lora_rank, tmp_path):
    hf = random_hf(tmp_path / "hf", q_lora_rank=q_lora_rank)
    config, model = imported(tmp_path / "hf")
    assert hf_architecture(config) == "deepseek_v3"
    assert (config.q_lora_rank, config.moe_layer_freq, config.rope_type, config.rotary_scaling_factor) == (
        q_lora_rank, (0, 1), "yarn", 4.0)
    assert (config.moe_router_num_groups, config.moe_router_group_topk, config.moe_router_topk_scaling_factor) == (
        4, 1, 2.5)
    assert config.mtp_num_layers == 0  # num_nextn_predict_layers=1, but transformers saves no such tensors
    assert_same_logits_and_loss(model, hf)

    export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back"))
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert before.keys() == after.keys() and "model.layers.1.mlp.gate.e_score_correction_bias" in after
    for k in before:
        assert torch.equal(before[k], after[k]), k
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    ids, _ = ids_and_labels()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=0, rtol=0)
    written = json.load(open(tmp_path / "back" / "config.json"))
    assert written["rope_parameters"] == {**YARN, "original_max_position_embeddings": 32}
    assert (written["n_group"], written["topk_group"], written["first_k_dense_replace"]) == (4, 1, 1)


def test_a_megazero_model_exports_to_transformers(tmp_path):
    """Plain RoPE, tied embeddings, one expert per token (no renormalisation), no groups, no expert bias."""
    config = GPTConfig(num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, seq_length=16,
                       max_position_embeddings=64, make_vocab_size_divisible_by=32, hidden_dropout=0.0,
                       attention_dropout=0.0, position_embedding_type="rope", normalization="rmsnorm",
                       activation="swiglu", add_bias_linear=False, multi_latent_attention=True, rope_type="rope",
                       q_lora_rank=None, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=16,
                       ffn_hidden_size=80, num_experts=4, moe_router_topk=1, moe_ffn_hidden_size=24,
                       moe_shared_expert_intermediate_size=48, moe_layer_freq=(0, 0, 1),
                       moe_router_score_function="sigmoid", layernorm_epsilon=1e-6).validate()
    torch.manual_seed(3)
    model = GPTModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    assert export_to_hf(gather_full_state_dict(model), config, str(tmp_path)) == "DeepseekV3ForCausalLM"
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert (hf.config.n_shared_experts, hf.config.first_k_dense_replace, hf.config.norm_topk_prob) == (2, 2, False)
    assert_same_logits_and_loss(model, hf)


def test_rotate_half_rope_layout_imports_as_the_same_function(tmp_path):
    hf = random_hf(tmp_path / "hf", rope_interleave=False)
    config, model = imported(tmp_path / "hf")
    assert_same_logits_and_loss(model, hf)
    export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back"))  # written interleaved
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert again.config.rope_interleave is True
    ids, _ = ids_and_labels()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(tmp_path / "back" / "model.safetensors"))
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert torch.equal(before[name][:16], after[name][:16]) and not torch.equal(before[name], after[name])


# ---- multi-token prediction -------------------------------------------------------------------------


def add_mtp_layer(hf_dir, hf) -> dict[str, torch.Tensor]:
    """DeepSeek's layout: module 0 as layer ``num_hidden_layers`` (a mixture, as DeepSeek-V3's), its own norms and
    projection and the copies of the embedding and output layer. Returns the tensors written."""
    sd = load_file(str(hf_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(5)
    n, h = hf.config.num_hidden_layers, hf.config.hidden_size
    for name in [k for k in sd if k.startswith(f"model.layers.{n - 1}.")]:
        moved = sd[name] + torch.randn(sd[name].shape, generator=g) * 0.05
        sd[name.replace(f"layers.{n - 1}.", f"layers.{n}.")] = moved
    p = f"model.layers.{n}."
    sd.update({p + "enorm.weight": 1 + torch.randn(h, generator=g) * 0.1,
               p + "hnorm.weight": 1 + torch.randn(h, generator=g) * 0.1,
               p + "eh_proj.weight": torch.randn(h, 2 * h, generator=g) * 0.05,
               p + "shared_head.norm.weight": 1 + torch.randn(h, generator=g) * 0.1,
               p + "embed_tokens.weight": sd["model.embed_tokens.weight"].clone(),
               p + "shared_head.head.weight": sd["lm_head.weight"].clone()})
    save_file(sd, str(hf_dir / "model.safetensors"), metadata={"format": "pt"})
    return sd


def reference_mtp_loss(hf, sd: dict[str, torch.Tensor], ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """DeepSeek's module 0 with transformers' decoder layer: CE of head(norm(layer(eh_proj([enorm(emb(t_{i+1}));
    hnorm(h_i)])))) against t_{i+2}, over the positions that have one; h the main model's output after its
    final norm (what its head reads: megazero.model.mtp's h^0, Megatron-core's and DeepSeek's)."""
    modeling = transformers.models.deepseek_v3.modeling_deepseek_v3
    n = hf.config.num_hidden_layers
    p = f"model.layers.{n}."
    layer = modeling.DeepseekV3DecoderLayer(hf.config, n).eval()
    own = {k[len(p):]: v for k, v in sd.items() if k.startswith(p) and not k[len(p):].startswith(
        ("enorm", "hnorm", "eh_proj", "shared_head", "embed_tokens", "mlp.experts."))}
    e = range(hf.config.n_routed_experts)  # transformers' module holds the experts stacked
    own["mlp.experts.gate_up_proj"] = torch.stack([torch.cat([sd[f"{p}mlp.experts.{i}.gate_proj.weight"],
                                                              sd[f"{p}mlp.experts.{i}.up_proj.weight"]]) for i in e])
    own["mlp.experts.down_proj"] = torch.stack([sd[f"{p}mlp.experts.{i}.down_proj.weight"] for i in e])
    layer.load_state_dict(own)
    rms = {}
    for key in ("enorm", "hnorm", "shared_head.norm"):
        rms[key] = modeling.DeepseekV3RMSNorm(hf.config.hidden_size, hf.config.rms_norm_eps)
        rms[key].weight.data.copy_(sd[p + key + ".weight"])
    with torch.no_grad():
        hidden = hf.model(ids).last_hidden_state  # after the final norm
        x = torch.cat([rms["enorm"](hf.model.embed_tokens(labels)), rms["hnorm"](hidden)], dim=-1)
        x = x @ sd[p + "eh_proj.weight"].t()
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        mask = transformers.masking_utils.create_causal_mask(config=hf.config, inputs_embeds=x, attention_mask=None,
                                                             cache=None, position_ids=positions)
        y = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=hf.model.rotary_emb(x, positions))
        logits = rms["shared_head.norm"](y) @ sd[p + "shared_head.head.weight"].t()
    targets = labels[:, 1:]
    return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), targets.flatten())


def test_multi_token_prediction_maps_both_ways_and_computes_deepseeks_formula(tmp_path):
    hf = random_hf(tmp_path / "hf")
    sd = add_mtp_layer(tmp_path / "hf", hf)
    config, model = imported(tmp_path / "hf")
    assert config.mtp_num_layers == 1 and "mtp.layers.0.transformer_layer.mlp.router.expert_bias" in model.state_dict()
    assert_same_logits_and_loss(model, hf)  # the prediction modules do not change the model's own outputs

    ids, labels = ids_and_labels()
    model.train()  # the modules' loss is a training-time output
    with torch.no_grad():
        model(ids, labels=labels)
    (ours,) = model.mtp.take()
    torch.testing.assert_close(ours[0], reference_mtp_loss(hf, sd, ids, labels), atol=1e-4, rtol=1e-4)

    export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back"))
    after = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert sd.keys() == after.keys()
    for k in sd:
        assert torch.equal(sd[k], after[k]), k
    assert json.load(open(tmp_path / "back" / "config.json"))["num_nextn_predict_layers"] == 1
    without, _ = imported(tmp_path / "hf", mtp_num_layers=0)  # dropped on request, as transformers loads it
    assert without.mtp_num_layers == 0


# ---- what is refused --------------------------------------------------------------------------------


@pytest.mark.parametrize("change, named", [
    (dict(n_group=4, topk_group=2, num_experts_per_tok=2), "num_experts_per_tok=2 with topk_group=2"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False with num_experts_per_tok=2"),
    (dict(scoring_func="softmax"), "scoring_func='softmax'"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config='fp8'"),
    (dict(rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0}), "rope type 'linear'"),
    (dict(rope_parameters={**YARN, "truncate": False}), "YaRN truncate=False"),
    (dict(attention_bias=True), "attention_bias=True"),
])
def test_configs_megazero_cannot_represent_are_refused_by_value(change, named):
    hf = {**hf_config().to_dict(), **change}
    with pytest.raises(ValueError) as e:
        config_from_hf(hf)
    assert named in str(e.value) and "\n" not in str(e.value), str(e.value)


KIMI_YARN = dict(factor=32.0, original_max_position_embeddings=8, beta_fast=1.0, beta_slow=1.0, mscale=1.0,
                 mscale_all_dim=1.0)


@pytest.mark.parametrize("family", ["kimi_k2", "moonlight"])
def test_kimi_k2_and_moonlight_shapes_match_transformers(family, tmp_path):
    """Kimi-K2 (its own model_type, one expert group, 4 experts per token, YaRN with beta_fast = beta_slow, written
    the older way: rope_scaling and rope_theta) and Moonlight (no query LoRA, plain RoPE, rms_norm_eps 1e-5 beside
    the latent norms' fixed 1e-6) differ from DeepSeek-V3 only in values."""
    if family == "kimi_k2":
        hf = random_hf(tmp_path / "hf", n_group=1, topk_group=1, num_experts_per_tok=4, routed_scaling_factor=2.827,
                       rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, **KIMI_YARN})
        path = tmp_path / "hf" / "config.json"
        written = json.load(open(path))
        del written["rope_parameters"]
        json.dump({**written, "model_type": "kimi_k2", "rope_theta": 50000.0, "num_nextn_predict_layers": 0,
                   "rope_scaling": {"type": "yarn", **KIMI_YARN}, "topk_method": "noaux_tc", "scoring_func": "sigmoid",
                   "moe_layer_freq": 1}, open(path, "w"))
    else:
        hf = random_hf(tmp_path / "hf", q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=3,
                       rope_parameters={"rope_type": "default", "rope_theta": 50000.0}, rms_norm_eps=1e-5)
    config, model = imported(tmp_path / "hf")
    assert (config.moe_router_num_groups, config.rotary_base) == (None, 50000.0)
    if family == "kimi_k2":
        assert (config.rotary_scaling_factor, config.beta_fast, config.beta_slow) == (32.0, 1.0, 1.0)
    else:
        assert (config.q_lora_rank, config.resolved_rope_type) == (None, "rope")
        assert (config.layernorm_epsilon, config.latent_norm_epsilon) == (1e-5, 1e-6)
    assert_same_logits_and_loss(model, hf)


def test_megazero_configs_hf_cannot_express_are_refused():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=VOCAB, seq_length=16,
                max_position_embeddings=16, position_embedding_type="rope", normalization="rmsnorm",
                activation="swiglu", add_bias_linear=False, multi_latent_attention=True, num_experts=8,
                moe_router_topk=4, moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32,
                moe_router_score_function="sigmoid", layernorm_epsilon=1e-6)
    for change, named in ((dict(layernorm_epsilon=1e-5), "set latent_layernorm_epsilon=1e-06"),
                          (dict(moe_router_num_groups=2, moe_router_group_topk=1), "moe_router_topk=4 with"),
                          (dict(moe_router_score_function="softmax"), "moe_router_score_function='softmax'"),
                          (dict(moe_layer_freq=(1, 0)), "moe_layer_freq=(1, 0)"),
                          (dict(moe_shared_expert_intermediate_size=None), "moe_shared_expert_intermediate_size=None")):
        with pytest.raises(ValueError, match=named.replace("(", r"\(").replace(")", r"\)")):
            hf_architecture(GPTConfig(**{**base, **change}).validate())
