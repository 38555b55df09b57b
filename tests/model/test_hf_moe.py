"""Hugging Face Mixtral, Qwen2-MoE (gated shared expert, QKV biases) and Qwen3-MoE (both routings) <-> megazero: random HF models imported give
transformers' logits within 1e-4 and export back to the same per-expert tensors bit for bit; a
megazero mixture exports to a directory transformers loads with its logits."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from safetensors.torch import load_file  # noqa: E402

from megazero.model import GPTModel  # noqa: E402
from megazero.model.interop.hf import export_to_hf, hf_architecture, import_from_hf  # noqa: E402
from megazero.model.state_dict import gather_full_state_dict, load_full_state_dict  # noqa: E402

COMMON = dict(vocab_size=90, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
              max_position_embeddings=32, num_experts_per_tok=2, tie_word_embeddings=False)


def _random_hf(kind: str, out_dir):
    torch.manual_seed(0)
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(transformers.MixtralConfig(intermediate_size=96, num_local_experts=4,
                                                                           **COMMON))
    elif kind == "qwen2_moe":
        model = transformers.Qwen2MoeForCausalLM(transformers.Qwen2MoeConfig(
            intermediate_size=96, moe_intermediate_size=48, shared_expert_intermediate_size=80, num_experts=4,
            **COMMON))
    else:
        model = transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=48, num_experts=4, norm_topk_prob=kind == "qwen3_moe_norm",
            **COMMON))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(str(out_dir))
    return model


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe", "qwen3_moe_norm"])
def test_import_matches_transformers_and_exports_back_bit_for_bit(kind, tmp_path):
    hf = _random_hf(kind, tmp_path / "hf")
    config, full_sd = import_from_hf(str(tmp_path / "hf"), make_vocab_size_divisible_by=32)
    assert hf_architecture(config) == kind.replace("_norm", "")
    # Qwen2/3 without norm_topk_prob: the full softmax's weights, not renormalised
    assert config.moe_router_pre_softmax == (kind in ("qwen2_moe", "qwen3_moe"))
    model = GPTModel(config).eval()
    load_full_state_dict(model, full_sd)
    ids = torch.randint(0, 90, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :90], hf(ids).logits, atol=1e-4, rtol=1e-4)
    export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back"))
    before, after = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert before.keys() == after.keys() and any(".experts.3." in k for k in after)
    for k in before:
        assert torch.equal(before[k], after[k]), k
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=0, rtol=0)


def test_mixtures_hf_cannot_express_are_refused():
    from megazero.model.config import GPTConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, seq_length=16, max_position_embeddings=16,
                vocab_size=90, num_experts=4, add_bias_linear=False, position_embedding_type="rope",
                normalization="rmsnorm", activation="swiglu")
    with pytest.raises(ValueError, match="moe_layer_freq=2"):
        hf_architecture(GPTConfig(**base, moe_layer_freq=2).validate())
    with pytest.raises(ValueError, match="moe_router_pre_softmax"):
        hf_architecture(GPTConfig(**base, moe_router_pre_softmax=True).validate())
