"""Hugging Face interop: megazero -> HF logits match ours; HF -> megazero -> HF is lossless."""

import importlib.util
import os
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from safetensors.torch import load_file  # noqa: E402

from megazero.model import GPTModel  # noqa: E402
from megazero.model.interop.hf import export_to_hf, hf_architecture, import_from_hf  # noqa: E402
from megazero.model.state_dict import gather_full_state_dict, load_full, load_full_state_dict, save_full  # noqa: E402
from tests.model.common import batch, tiny_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def _tool(name):
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _perturbed_model(config, seed=0):
    torch.manual_seed(seed)
    model = GPTModel(config).eval()
    with torch.no_grad():  # move norms/biases off their ones/zeros init so the mapping is really tested
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


CONFIGS = {
    "gpt2": tiny_config("gpt"),
    "llama_gqa_untied": tiny_config("llama"),
    "llama_bias_tied": tiny_config("llama", add_bias_linear=True, tie_embeddings=True, rotary_base=500000.0),
    # Megatron options HF can express: head_dim != hidden/heads, LayerNorm1P, training-only flags
    "llama_kv_channels_1p": tiny_config("llama", kv_channels=12, apply_layernorm_1p=True, init_method="xavier_uniform",
                                        fp32_residual_connection=True, apply_query_key_layer_scaling=True),
    "gpt2_1p": tiny_config("gpt", apply_layernorm_1p=True),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_export_logits_match_hf(name, tmp_path):
    config = CONFIGS[name]
    model = _perturbed_model(config)
    arch = export_to_hf(gather_full_state_dict(model), config, str(tmp_path))
    assert arch == ("GPT2LMHeadModel" if name.startswith("gpt2") else "LlamaForCausalLM")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path)).eval()
    assert type(hf).__name__ == arch
    ids, labels = batch(config)
    with torch.no_grad():
        ours = model(ids)
        theirs = hf(ids).logits
        assert theirs.shape[-1] == config.vocab_size
        torch.testing.assert_close(ours[..., : config.vocab_size], theirs, atol=1e-4, rtol=1e-4)
        assert torch.isinf(ours[..., config.vocab_size:]).all()  # padding is never predicted
        # ... so the losses agree too
        hf_loss = torch.nn.functional.cross_entropy(theirs.flatten(0, 1), labels.flatten(), reduction="none")
        torch.testing.assert_close(model(ids, labels=labels).flatten(), hf_loss, atol=1e-4, rtol=1e-4)


def _random_hf(name, tmp_path):
    torch.manual_seed(0)
    if name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=90, n_positions=32, n_embd=64, n_layer=2, n_head=4)
        model = transformers.GPT2LMHeadModel(cfg)
    else:
        cfg = transformers.LlamaConfig(vocab_size=90, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=32,
                                       tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval().save_pretrained(str(tmp_path))
    return model


@pytest.mark.parametrize("name, overrides", [("gpt2", {}), ("llama", {}), ("gpt2", {"apply_layernorm_1p": True}),
                                             ("llama", {"apply_layernorm_1p": True})])
def test_import_then_export_is_lossless(name, overrides, tmp_path):
    hf = _random_hf(name, tmp_path / "hf")
    config, full_sd = import_from_hf(str(tmp_path / "hf"), make_vocab_size_divisible_by=32, **overrides)
    assert hf_architecture(config) == name
    model = GPTModel(config).eval()
    load_full_state_dict(model, full_sd)
    ids, _ = batch(config)
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :90], hf(ids).logits, atol=1e-4, rtol=1e-4)

    export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back"))
    before, after = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    before.pop("lm_head.weight", None) if config.tie_embeddings else None
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


def test_command_line_tools_round_trip(tmp_path):
    _random_hf("gpt2", tmp_path / "hf")
    assert _tool("convert_from_hf").main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz"),
                                          "--override", "make_vocab_size_divisible_by=32",
                                          "--override", "attention_backend=math"]) == 0
    config, full_sd = load_full(str(tmp_path / "mz"))
    assert config.attention_backend == "math" and config.padded_vocab_size == 96
    assert _tool("convert_to_hf").main(["--input", str(tmp_path / "mz"), "--output", str(tmp_path / "back")]) == 0
    before, after = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert all(torch.equal(before[k], after[k]) for k in after)
    # a plain file plus --config works too
    save_full(str(tmp_path / "plain"), full_sd, config)
    os.rename(tmp_path / "plain" / "config.json", tmp_path / "cfg.json")
    assert _tool("convert_to_hf").main(["--input", str(tmp_path / "plain" / "model_full.safetensors"),
                                        "--config", str(tmp_path / "cfg.json"), "--output", str(tmp_path / "b2")]) == 0


def test_unrepresentable_configs_are_refused(tmp_path, capsys):
    bad = tiny_config("gpt", position_embedding_type="rope")
    with pytest.raises(ValueError, match="not representable in HF GPT-2 or Llama.*position_embedding_type='rope'"):
        hf_architecture(bad)
    with pytest.raises(ValueError, match="num_query_groups=4"):
        hf_architecture(tiny_config("gpt", num_query_groups=4))
    save_full(str(tmp_path / "bad"), gather_full_state_dict(GPTModel(bad)), bad)
    assert _tool("convert_to_hf").main(["--input", str(tmp_path / "bad"), "--output", str(tmp_path / "out")]) == 1
    assert "not representable" in capsys.readouterr().err


@pytest.mark.parametrize("arch, changes, field", [
    ("gpt", dict(qk_layernorm=True), "qk_layernorm=True"),
    ("llama", dict(qk_layernorm=True, add_bias_linear=True), "qk_layernorm=True"),  # without biases: Qwen3
    ("llama", dict(rotary_percent=0.5), "rotary_percent=0.5"),
    ("gpt", dict(activation="squared_relu"), "activation='squared_relu'"),
    ("gpt", dict(position_embedding_type="none"), "position_embedding_type='none'"),
    ("gpt", dict(kv_channels=12), "kv_channels=12"),
])
def test_megatron_only_options_are_refused_by_name(arch, changes, field):
    with pytest.raises(ValueError) as e:
        hf_architecture(tiny_config(arch, **changes))
    assert field in str(e.value)


def test_llama_head_dim_imports_as_kv_channels(tmp_path):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=90, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=32)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    hf.save_pretrained(str(tmp_path))
    config, full_sd = import_from_hf(str(tmp_path), make_vocab_size_divisible_by=32)
    assert config.kv_channels == 24
    model = GPTModel(config).eval()
    load_full_state_dict(model, full_sd)
    ids, _ = batch(config)
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :90], hf(ids).logits, atol=1e-4, rtol=1e-4)


def test_original_gpt2_key_names_are_accepted():
    # openai-community/gpt2 stores GPT2Model keys (no "transformer." prefix) and old mask buffers.
    from megazero.model.interop.hf import from_hf_state_dict, to_hf_state_dict

    config = tiny_config("gpt")
    full = gather_full_state_dict(_perturbed_model(config))
    hf_sd = to_hf_state_dict(full, config)
    legacy = {k.removeprefix("transformer."): v for k, v in hf_sd.items()}
    legacy["h.0.attn.bias"] = torch.ones(1, 1, 16, 16)
    back = from_hf_state_dict(legacy, config)
    emb, V = back.pop("embedding.weight"), config.vocab_size
    assert torch.equal(emb[:V], full["embedding.weight"][:V]) and not emb[V:].any()  # padding comes back as zeros
    assert all(torch.equal(back[k], full[k]) for k in back)
    with pytest.raises(KeyError, match="does not use"):
        from_hf_state_dict({**hf_sd, "transformer.h.9.ln_1.weight": torch.ones(64)}, config)
    with pytest.raises(KeyError, match="lacks 'transformer.wpe.weight'"):
        from_hf_state_dict({k: v for k, v in hf_sd.items() if "wpe" not in k}, config)
