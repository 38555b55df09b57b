"""Hugging Face Nemotron-H <-> megazero, against transformers' NemotronHForCausalLM (fp32, eager attention and
experts, its PyTorch convolution and chunked scan): tiny random models over 70 tokens (Mamba-2 with two groups of
B and C, a state of 8 and HF chunks of 16 where megazero scans 128 at once; attention with GQA and head_dim free;
squared-ReLU MLPs; a sigmoid-routed mixture with a correction bias, group-limited routing, a routed scaling and a
shared expert; a variant with biases) import with transformers' logits, export back bit for bit to a directory
transformers loads, and generate greedily as transformers does (its cache carrying the convolution and scan
states). Both spellings of the layer types and the Hub's hybrid_override_pattern read alike; transformers'
in-memory layout (``model.``, stacked experts) imports; a megazero-made model (LayerNorm-1p weights) exports to
transformers' logits; the Mamba width is checked against the weights; what megazero cannot represent is refused."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Nemotron-H reference is transformers'")

from safetensors.torch import load_file, save_file  # noqa: E402

from megazero.model import GPTConfig, GPTModel  # noqa: E402
from megazero.model.interop.hf import config_from_hf, export_to_hf, hf_architecture, import_from_hf  # noqa: E402
from megazero.model.sampling import generate  # noqa: E402
from megazero.model.state_dict import gather_full_state_dict, load_full_state_dict  # noqa: E402

VOCAB, T = 100, 70
REFERENCE = dict(attn_implementation="eager", experts_implementation="eager")
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=8,
             chunk_size=16, conv_kernel=4, num_attention_heads=4, num_key_value_heads=2, head_dim=12,
             intermediate_size=48, max_position_embeddings=128)
MOE = dict(n_routed_experts=8, num_experts_per_tok=4, moe_intermediate_size=24, moe_shared_expert_intermediate_size=40,
           routed_scaling_factor=2.5, n_group=4, topk_group=2)  # 2 of 4 groups, each scored by its 2 best
VARIANTS = {
    # Megatron's older spelling of the types, every kind of block
    "moe": dict(layers_block_type=["mamba", "moe", "attention", "mlp", "mamba"], **MOE),
    # the Hub's pattern string
    "dense": dict(hybrid_override_pattern="M*-M-"),
    # biases on the Mamba projections and the MLPs (no attention or experts, which have none)
    "biased": dict(layers_block_type=["linear_attention", "mlp", "linear_attention"], use_bias=True, mlp_bias=True),
}


def hf_config(variant: str, **kw):
    return transformers.NemotronHConfig(**{**SHAPE, **VARIANTS[variant], **kw}, **REFERENCE)


def perturb(model, seed: int = 0):
    """Every parameter moved off its init (A = 1..H, D and dt_bias 1, the norms 1, zero biases) and the routers'
    correction biases (buffers) made to change which experts are chosen."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.2)
    return model.eval()


def random_hf(variant: str, hf_dir=None, **kw):
    model = perturb(transformers.NemotronHForCausalLM(hf_config(variant, **kw)))
    if hf_dir is not None:
        model.save_pretrained(str(hf_dir))
    return model


def ids(batch: int = 2, length: int = T, seed: int = 7):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def ours(hf_dir, **overrides):
    config, full_sd = import_from_hf(str(hf_dir), make_vocab_size_divisible_by=48, **overrides)  # 144 rows
    model = GPTModel(config).eval()
    load_full_state_dict(model, full_sd)
    return config, model


def max_diff(model, hf, tokens) -> float:
    with torch.no_grad():
        return (model(tokens)[..., :VOCAB] - hf(tokens, use_cache=False).logits).abs().max().item()


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_import_matches_transformers_and_exports_back_bit_for_bit(variant, tmp_path):
    hf = random_hf(variant, tmp_path / "hf")
    config, model = ours(tmp_path / "hf")
    assert hf_architecture(config) == "nemotron_h"
    pattern = {"moe": "ME*-M", "dense": "M*-M-", "biased": "M-M"}[variant]
    assert (config.hybrid_layer_pattern, config.position_embedding_type, config.activation, config.normalization) == (
        pattern, "none", "squared_relu", "rmsnorm")
    assert (config.mamba_heads, config.mamba_head_dim, config.mamba_num_groups, config.mamba_state_dim,
            config.linear_conv_kernel_dim, config.head_dim, config.query_groups, config.ffn_size,
            config.add_bias_linear, config.tie_embeddings) == (4, 16, 2, 8, 4, 12, 2, 48, variant == "biased", False)
    if variant == "moe":
        assert (config.num_experts, config.moe_router_topk, config.moe_ffn_size, config.moe_router_score_function,
                config.moe_router_enable_expert_bias, config.moe_router_topk_scaling_factor,
                config.moe_router_num_groups, config.moe_router_group_topk,
                config.moe_shared_expert_intermediate_size) == (8, 4, 24, "sigmoid", True, 2.5, 4, 2, 40)
    diff = max_diff(model, hf, ids())
    assert diff < 1e-4, diff

    assert export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back")) == "NemotronHForCausalLM"
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    saved, original = (json.load(open(d / "config.json")) for d in (tmp_path / "back", tmp_path / "hf"))
    for key in ("model_type", "architectures", "layers_block_type", "hidden_size", "mamba_num_heads", "mamba_head_dim",
                "n_groups", "ssm_state_size", "conv_kernel", "head_dim", "num_key_value_heads", "intermediate_size",
                "use_bias", "mlp_bias", "layer_norm_epsilon", "tie_word_embeddings", "n_routed_experts",
                "num_experts_per_tok", "moe_intermediate_size", "moe_shared_expert_intermediate_size",
                "routed_scaling_factor", "n_group", "topk_group", "norm_topk_prob", "residual_in_fp32"):
        assert saved.get(key) == original.get(key), key
    assert saved["chunk_size"] == 128  # megazero's scan block
    again, _ = import_from_hf(str(tmp_path / "back"), make_vocab_size_divisible_by=48)
    assert again == config
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), **REFERENCE).eval()
    with torch.no_grad():
        expected = hf(ids(), use_cache=False).logits
        torch.testing.assert_close(back(ids(), use_cache=False).logits, expected, atol=1e-5, rtol=0)  # chunks of 128
        for layer in back.model.layers:
            if hasattr(layer.mixer, "chunk_size"):
                layer.mixer.chunk_size = 16  # the original's: the same rounding, the same logits
        torch.testing.assert_close(back(ids(), use_cache=False).logits, expected, atol=0, rtol=0)


@pytest.mark.parametrize("variant", ["moe", "dense"])
def test_greedy_generation_equals_transformers(variant, tmp_path):
    """transformers' generate (its cache: the convolution's and the scan's states, the attention's keys) against
    megazero's generate (the whole sequence each step), from a prompt longer than four HF chunks."""
    hf = random_hf(variant, tmp_path)
    _, model = ours(tmp_path)
    prompt = ids(1, 66)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                               pad_token_id=0)  # the prompt may hold id 0: the mask says it is no padding
    got = generate(model, prompt, 8, seq_length=128, vocab_size=VOCAB, temperature=0.0)
    assert got.tolist() == expected.tolist()


def test_both_spellings_and_the_pattern_string_read_alike():
    base = {k: v for k, v in hf_config("moe").to_dict().items() if k != "layers_block_type"}
    old = config_from_hf({**base, "layers_block_type": ["mamba", "attention", "mlp", "moe"]})
    new = config_from_hf({**base, "layers_block_type": ["linear_attention", "full_attention", "mlp", "moe"]})
    hub = config_from_hf({**{k: v for k, v in base.items() if k not in ("n_groups", "conv_kernel")},
                          "hybrid_override_pattern": "M*-E", "num_hidden_layers": 4, "mamba_n_groups": 2,
                          "mamba_d_conv": 4})  # and older names of the Mamba fields
    assert old == new == hub and old.hybrid_layer_pattern == "M*-E"


def test_transformers_layout_and_mtp_weights_import(tmp_path):
    """transformers' in-memory names (``model.``, experts stacked [E, f, h] and [E, h, f]) read as the Hub's, and
    multi-token prediction weights (``mtp.*``) are left out as transformers leaves them."""
    hf = random_hf("moe", tmp_path / "hf", num_nextn_predict_layers=1)
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.mixer.experts.up_proj" in sd and "model.embeddings.weight" in sd
    sd["mtp.layers.0.norm.weight"] = torch.ones(32)
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"))
    config, model = ours(tmp_path / "hf")
    assert config.mtp_num_layers == 0
    assert max_diff(model, hf, ids()) < 1e-4


def test_no_conv_bias_and_a_stored_head_import_as_transformers_runs_them(tmp_path):
    """use_conv_bias false: zero biases; tie_word_embeddings with its own lm_head.weight (transformers 5 loads it
    and does not tie): untied, with that head."""
    hf = random_hf("dense", tmp_path / "hf", use_conv_bias=False, tie_word_embeddings=True)
    assert not torch.equal(hf.lm_head.weight, hf.model.embeddings.weight)
    config, model = ours(tmp_path / "hf")
    assert not config.tie_embeddings
    assert torch.equal(model.state_dict()["layers.0.mixer.conv_bias"], torch.zeros(96))
    assert max_diff(model, hf, ids()) < 1e-4


def test_a_megazero_model_exports_to_transformers_logits(tmp_path):
    """A model made here (LayerNorm-1p weights, fp32 residual, tied, a mixture without expert bias) exports to a
    directory transformers runs with megazero's logits."""
    config = GPTConfig(num_layers=4, hybrid_layer_pattern="M*EM", hidden_size=32, num_attention_heads=2,
                       num_query_groups=1, vocab_size=VOCAB, make_vocab_size_divisible_by=48, mamba_num_heads=4,
                       mamba_head_dim=8, mamba_num_groups=1, mamba_state_dim=8, num_experts=4, moe_router_topk=1,
                       moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=16,
                       moe_router_score_function="sigmoid", apply_layernorm_1p=True, fp32_residual_connection=True,
                       activation="squared_relu", normalization="rmsnorm", add_bias_linear=False,
                       position_embedding_type="none", hidden_dropout=0.0, attention_dropout=0.0).validate()
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    export_to_hf(gather_full_state_dict(model), config, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), **REFERENCE).eval()
    assert (hf.config.norm_topk_prob, hf.config.residual_in_fp32, hf.config.tie_word_embeddings) == (False, True, True)
    diff = max_diff(model, hf, ids())
    assert diff < 1e-4, diff


def test_the_mamba_width_is_checked_against_the_weights(tmp_path):
    random_hf("dense", tmp_path)
    saved = json.load(open(tmp_path / "config.json"))
    json.dump({**saved, "mamba_head_dim": 8}, open(tmp_path / "config.json", "w"))  # 4 x 8, the weights 64 wide
    with pytest.raises(ValueError, match="the weights are 64 wide.*mamba_num_heads \\* mamba_head_dim"):
        import_from_hf(str(tmp_path))


@pytest.mark.parametrize("change, message", [
    (dict(mamba_hidden_act="gelu"), "mamba_hidden_act='gelu'"),
    (dict(mlp_hidden_act="silu"), "mlp_hidden_act='silu'"),
    (dict(moe_latent_size=16), "moe_latent_size=16"),
    (dict(time_step_limit=[0.0, 1.0]), "time_step_limit"),
    (dict(attention_bias=True), "attention_bias=True"),
    (dict(use_bias=True, mlp_bias=True), "attention or expert layers"),
    (dict(norm_topk_prob=False), "norm_topk_prob=False"),
    (dict(topk_group=1), "num_experts_per_tok=4 with topk_group=1"),
    (dict(layers_block_type=["mamba", "sliding_attention"]), "layers_block_type values \\['sliding_attention'\\]"),
    (dict(layers_block_type=None, hybrid_override_pattern="M*E/*E"), "keep the part before the first '/'"),
])
def test_what_megazero_cannot_represent_is_refused(change, message):
    base = hf_config("moe").to_dict()
    with pytest.raises(ValueError, match=message):
        config_from_hf({**base, **change})


def test_what_nemotron_h_cannot_represent_is_refused_on_export():
    config = config_from_hf(hf_config("moe").to_dict())
    for change, message in ((dict(mtp_num_layers=1), "set mtp_num_layers=0 to export the model without them"),
                            (dict(activation="swiglu"), "activation='swiglu'"),
                            (dict(moe_shared_expert_intermediate_size=None), "every Nemotron-H mixture has a shared"),
                            (dict(moe_router_group_topk=1), "moe_router_topk = 2 x moe_router_group_topk"),
                            (dict(add_bias_linear=True), "attention and experts have no biases")):
        with pytest.raises(ValueError, match="NemotronHForCausalLM.*" + message):
            hf_architecture(config.replace(**change))
