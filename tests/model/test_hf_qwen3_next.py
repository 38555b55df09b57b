"""Hugging Face Qwen3-Next and Qwen3.5 (dense and MoE) <-> megazero, against transformers' own models (fp32, eager
attention and experts, the PyTorch gated delta rule and convolution): tiny random models (Gated DeltaNet with two
key heads serving four value heads, gated attention with q/k norms and partial RoPE, a mixture with a gated shared
expert and, for Qwen3-Next, a dense layer) over 70 tokens, two chunks of the delta rule, import with transformers'
logits; export back bit for bit to a directory transformers loads; generate greedily as transformers does (its
cache carrying the recurrent state). The multimodal Qwen3.5 checkpoint imports as its text model; what megazero
cannot represent is refused."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the Qwen3-Next reference is transformers'")

from safetensors.torch import load_file, save_file  # noqa: E402

from megazero.model import GPTModel  # noqa: E402
from megazero.model.interop.hf import config_from_hf, export_to_hf, hf_architecture, import_from_hf  # noqa: E402
from megazero.model.sampling import generate  # noqa: E402
from megazero.model.state_dict import gather_full_state_dict, load_full_state_dict  # noqa: E402

VOCAB, T = 128, 70
REFERENCE = dict(attn_implementation="eager", experts_implementation="eager")
SHAPE = dict(vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
             linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
             max_position_embeddings=128)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
# family -> (config class, its keywords): irregular layer_types and a dense layer (Qwen3-Next, with half the head
# rotating), a regular interval (Qwen3.5), the shortest hybrid (Qwen3.5-MoE)
FAMILIES = {
    "qwen3_next": ("Qwen3NextConfig", dict(
        num_hidden_layers=4, intermediate_size=64, mlp_only_layers=[2], **MOE,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})),
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(num_hidden_layers=4, intermediate_size=64, full_attention_interval=2,
                                               tie_word_embeddings=True)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(num_hidden_layers=2, **MOE,
                                                      layer_types=["linear_attention", "full_attention"])),
}


def hf_config(family: str, **kw):
    cls, base = FAMILIES[family]
    return getattr(transformers, cls)(**{**SHAPE, **base, **kw}, **REFERENCE)


def perturb(model, seed: int = 0):
    """Every parameter moved off its init (the (1 + w) norms' zeros, the router's zeros, dt_bias's ones)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def random_hf(family: str, hf_dir=None, **kw):
    model = perturb(transformers.AutoModelForCausalLM.from_config(hf_config(family, **kw), **REFERENCE))
    if hf_dir is not None:
        model.save_pretrained(str(hf_dir))
    return model


def ids(batch: int = 2, length: int = T, seed: int = 7):
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def ours(hf_dir):
    config, full_sd = import_from_hf(str(hf_dir), make_vocab_size_divisible_by=48)  # 144 rows: padding too
    model = GPTModel(config).eval()
    load_full_state_dict(model, full_sd)
    return config, model


def _max_diff(model, hf, tokens) -> float:
    with torch.no_grad():
        return (model(tokens)[..., :VOCAB] - hf(tokens).logits).abs().max().item()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_import_matches_transformers_and_exports_back_bit_for_bit(family, tmp_path):
    hf = random_hf(family, tmp_path / "hf")
    config, model = ours(tmp_path / "hf")
    assert hf_architecture(config) == family == config.hf_model_type
    assert (config.apply_layernorm_1p, config.qk_layernorm, config.attention_output_gate, config.head_dim,
            config.query_groups, config.layernorm_epsilon) == (True, True, True, 8, 2, 1e-6)
    want = {"qwen3_next": ((1, 0, 1, 1), (1, 1, 0, 1), 0.5), "qwen3_5_text": (2, 1, 0.25),
            "qwen3_5_moe_text": (2, 1, 0.25)}[family]
    assert (config.linear_attention_freq, config.moe_layer_freq, config.rotary_percent) == want
    assert bool(config.num_experts) == (family != "qwen3_5_text")
    assert config.tie_embeddings == (family == "qwen3_5_text")
    diff = _max_diff(model, hf, ids())
    assert diff < 1e-4, diff

    assert export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back")) == hf.config.architectures[0]
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    saved, original = (json.load(open(d / "config.json")) for d in (tmp_path / "back", tmp_path / "hf"))
    for key in ("model_type", "layer_types", "rope_parameters", "linear_num_value_heads", "head_dim",
                "tie_word_embeddings", "num_experts", "mlp_only_layers", "norm_topk_prob", "intermediate_size"):
        assert saved.get(key) == original.get(key), key
    again, _ = import_from_hf(str(tmp_path / "back"), make_vocab_size_divisible_by=48)
    assert again == config
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), **REFERENCE).eval()
    with torch.no_grad():
        torch.testing.assert_close(back(ids()).logits, hf(ids()).logits, atol=0, rtol=0)


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_text"])
def test_greedy_generation_equals_transformers(family, tmp_path):
    """transformers' generate (its cache: the convolution's and the delta rule's states, one token a step) against
    megazero's generate (the whole sequence each step), from a prompt longer than a chunk."""
    hf = random_hf(family, tmp_path)
    _, model = ours(tmp_path)
    prompt = ids(1, 66)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, do_sample=False,
                               pad_token_id=0)  # the prompt holds id 0: the mask says it is no padding
    got = generate(model, prompt, 8, seq_length=128, vocab_size=VOCAB, temperature=0.0)
    assert got.tolist() == expected.tolist()


def test_the_multimodal_qwen3_5_imports_as_its_text_model(tmp_path, caplog):
    """Qwen3_5ForConditionalGeneration's checkpoint (text weights under model.language_model., a vision tower, here
    tied embeddings at the wrapper's level): the text model's logits, exported as Qwen3_5ForCausalLM."""
    _, text = FAMILIES["qwen3_5_text"]
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32, patch_size=2,
                  temporal_patch_size=1, num_position_embeddings=16)
    cfg = transformers.Qwen3_5Config(text_config={**SHAPE, **text, "tie_word_embeddings": False},
                                     vision_config=vision, tie_word_embeddings=True)
    hf = perturb(transformers.Qwen3_5ForConditionalGeneration(cfg))
    hf.save_pretrained(str(tmp_path / "hf"))
    names = load_file(str(tmp_path / "hf" / "model.safetensors")).keys()
    assert any(k.startswith("model.visual.") for k in names) and "model.language_model.norm.weight" in names
    with caplog.at_level("INFO"):
        config, model = ours(tmp_path / "hf")
    assert "dropped model.visual.* (vision tower)" in caplog.text
    assert (config.hf_model_type, config.tie_embeddings) == ("qwen3_5_text", True)
    diff = _max_diff(model, hf, ids())
    assert diff < 1e-4, diff
    assert export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back")) == "Qwen3_5ForCausalLM"


def test_stacked_experts_and_mtp_weights_import(tmp_path, caplog):
    """transformers' in-memory layout (experts stacked [E, 2f, h] and [E, h, f]) reads as save_pretrained's, and a
    Hub checkpoint's multi-token prediction weights (mtp.*) are dropped with a note."""
    hf = random_hf("qwen3_next", tmp_path / "hf")
    sd = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in sd
    sd["mtp.fc.weight"] = torch.zeros(32, 64)
    save_file(sd, str(tmp_path / "hf" / "model.safetensors"))
    with caplog.at_level("INFO"):
        config, model = ours(tmp_path / "hf")
    assert "dropped mtp.* (multi-token prediction)" in caplog.text
    assert _max_diff(model, hf, ids()) < 1e-4


def test_what_megazero_cannot_represent_is_refused():
    base = hf_config("qwen3_next").to_dict()
    with pytest.raises(ValueError, match="rope type 'yarn'"):
        config_from_hf({**base, "rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="attention_bias=True"):
        config_from_hf({**base, "attention_bias": True})
    with pytest.raises(ValueError, match="layer_types"):
        config_from_hf({**base, "layer_types": ["linear_attention", "sliding_attention"] * 2})
    config = config_from_hf(base)
    with pytest.raises(ValueError, match="Qwen3_5MoeForCausalLM.*every Qwen3.5-MoE layer is a mixture"):
        hf_architecture(config.replace(hf_model_type="qwen3_5_moe_text"))
    with pytest.raises(ValueError, match="Qwen3NextForCausalLM.*qk_layernorm=False"):
        hf_architecture(config.replace(qk_layernorm=False))
    assert hf_architecture(config.replace(hf_model_type=None)) == "qwen3_next"  # a mixture: Qwen3-Next
