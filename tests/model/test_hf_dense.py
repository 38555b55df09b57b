"""The dense Hugging Face families beside Llama: Llama 3.1's RoPE scaling, Qwen2 (q/k/v biases), Qwen3 (per-head
q/k RMSNorm, head_dim != hidden/heads), Mistral; with sliding windows shorter than the sequence (Mistral's in every
layer, Qwen's in the layers its max_window_layers or layer_types name). Each imports with transformers' logits,
exports back bit for bit, and generates greedily as transformers does; what megazero cannot run is refused."""

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from safetensors.torch import load_file  # noqa: E402

from megazero.model import GPTModel  # noqa: E402
from megazero.model.attention.rope import RotaryEmbedding, rotary_embedding  # noqa: E402
from megazero.model.interop.hf import config_from_hf, export_to_hf, hf_architecture, import_from_hf  # noqa: E402
from megazero.model.state_dict import gather_full_state_dict, load_full_state_dict  # noqa: E402

VOCAB, SEQ = 128, 32
SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=SEQ)
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 16, "rope_theta": 10000.0}
FAMILIES = {
    "llama3": ("LlamaConfig", "LlamaForCausalLM", dict(rope_parameters=LLAMA3, tie_word_embeddings=False)),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(tie_word_embeddings=True)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, tie_word_embeddings=False)),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=None, tie_word_embeddings=False)),
    "mistral_window": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=7, tie_word_embeddings=False)),
    "qwen2_window": ("Qwen2Config", "Qwen2ForCausalLM", dict(use_sliding_window=True, sliding_window=5,
                                                             max_window_layers=1, tie_word_embeddings=True)),
    "qwen3_window": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=24, use_sliding_window=True, sliding_window=9,
                                                             layer_types=["sliding_attention", "full_attention"],
                                                             tie_word_embeddings=False)),
}
FAMILY = {"llama3": "llama", "mistral_window": "mistral", "qwen2_window": "qwen2", "qwen3_window": "qwen3"}


def random_hf(name: str, hf_dir=None):
    """A tiny random transformers model of family ``name``, its norms and biases moved off their init."""
    config_cls, model_cls, extra = FAMILIES[name]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**SHAPE, **extra))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.eval()
    if hf_dir is not None:
        model.save_pretrained(str(hf_dir))
    return model


def _ids():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(7))


def _ours(hf_dir):
    config, full_sd = import_from_hf(str(hf_dir), make_vocab_size_divisible_by=32)
    model = GPTModel(config).eval()
    load_full_state_dict(model, full_sd)
    return config, model


@pytest.mark.parametrize("name", list(FAMILIES))
def test_import_matches_transformers_and_exports_back_bit_for_bit(name, tmp_path):
    hf = random_hf(name, tmp_path / "hf")
    config, model = _ours(tmp_path / "hf")
    family = FAMILY.get(name, name)
    assert hf_architecture(config) == family
    ids = _ids()
    with torch.no_grad():
        ours, theirs = model(ids)[..., :VOCAB], hf(ids).logits
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)

    assert export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back")) == FAMILIES[name][1]
    before, after = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    if config.tie_embeddings:
        before.pop("lm_head.weight", None)
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    saved = json.load(open(tmp_path / "back" / "config.json"))
    assert saved["model_type"] == family and saved["architectures"] == [FAMILIES[name][1]]
    again, _ = import_from_hf(str(tmp_path / "back"), make_vocab_size_divisible_by=32)
    assert again == config  # the exported config.json reads back as the same model
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(back).__name__ == FAMILIES[name][1]
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, theirs, atol=0, rtol=0)
        prompt = ids[:1, :6]
        hf.generation_config.eos_token_id = None
        expected = hf.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)[0, 6:]
        tokens = prompt
        for _ in range(6):  # greedy, from the whole sequence each step
            tokens = torch.cat([tokens, model(tokens)[:, -1, :VOCAB].argmax(-1, keepdim=True)], dim=1)
    assert tokens[0, 6:].tolist() == expected.tolist()


def test_llama3_scaling_changes_the_frequencies_plain_rope_misses(tmp_path):
    """original_max_position_embeddings 16 < 32 positions: the scaled model is not plain RoPE's."""
    hf = random_hf("llama3", tmp_path)
    config, model = _ours(tmp_path)
    assert (config.rope_type, config.rotary_scaling_factor, config.low_freq_factor, config.high_freq_factor,
            config.original_max_position_embeddings) == ("llama3", 8.0, 1.0, 4.0, 16)
    ref = transformers.modeling_rope_utils.ROPE_INIT_FUNCTIONS["llama3"](hf.config, None)[0]
    assert torch.equal(rotary_embedding(config).inv_freq(), ref)  # transformers' operations, bit for bit
    assert not torch.allclose(RotaryEmbedding(config.head_dim, config.rotary_base).inv_freq(), ref)
    plain_cfg = config_from_hf({**json.load(open(tmp_path / "config.json")), "rope_parameters": {"rope_theta": 10000.0,
                                                                                               "rope_type": "default"}},
                               make_vocab_size_divisible_by=32)
    plain_model = GPTModel(plain_cfg).eval()
    plain_model.load_state_dict(model.state_dict())
    ids = _ids()
    with torch.no_grad():
        gap = (plain_model(ids)[..., :VOCAB] - hf(ids).logits).abs().max().item()
    assert gap > 1e-3, gap


def test_llama3_rope_scaling_of_transformers_4():
    """4.x's config.json: rope_theta apart, rope_scaling with 'rope_type' (or 'type')."""
    hf = {**SHAPE, "model_type": "llama", "rope_theta": 500000.0, "max_position_embeddings": 131072,
          "rope_scaling": {"type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}
    c = config_from_hf(hf)
    assert (c.rope_type, c.rotary_base, c.rotary_scaling_factor, c.original_max_position_embeddings) == (
        "llama3", 500000.0, 32.0, 8192)


@pytest.mark.parametrize("hf, message", [
    ({"model_type": "llama", "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0}},
     "rope type 'llama3' without low_freq_factor"),
    ({"model_type": "llama", "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, "rope type 'dynamic'"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 16,
      "layer_types": ["chunked_attention", "full_attention"]}, "layer_types ['chunked_attention']"),
    ({"model_type": "mistral", "sliding_window": 0}, "sliding_window=0 (a query sees at least itself"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
])
def test_what_megazero_cannot_run_is_refused_in_one_line(hf, message):
    with pytest.raises(ValueError) as e:
        config_from_hf({**SHAPE, **hf})
    assert message in str(e.value) and "\n" not in str(e.value)


def test_hf_windows_read_as_transformers_applies_them():
    """HF's window W is W - 1 keys before the query; Qwen slides only with use_sliding_window, from
    max_window_layers on (or where layer_types says)."""
    mistral = config_from_hf({**SHAPE, "model_type": "mistral", "sliding_window": 4096})
    assert (mistral.window_size, mistral.window_attn_skip_freq) == ((4095, 0), None)
    qwen = dict(SHAPE, model_type="qwen2", sliding_window=16)
    assert config_from_hf({**qwen, "use_sliding_window": False, "max_window_layers": 0}).window_size is None
    assert config_from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 2}).window_size is None
    both = config_from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 0})
    assert (both.window_size, both.window_attn_skip_freq) == ((15, 0), None)
    last = config_from_hf({**qwen, "use_sliding_window": True, "max_window_layers": 1})
    assert [last.layer_window(i) for i in range(2)] == [None, 15]


def test_exports_that_would_lose_the_window_or_the_sinks_are_refused():
    base = config_from_hf({**SHAPE, "model_type": "llama"})
    for changed, message in ((dict(softmax_type="learnable"), "attention sinks"),
                             (dict(window_size=(7, 0), window_attn_skip_freq=2), "in some layers only"),
                             (dict(window_size=(7, 0), add_bias_linear=True), "with biases")):
        with pytest.raises(ValueError, match=message):
            hf_architecture(base.replace(**changed))
