"""Hugging Face gpt-oss <-> megazero, against transformers' GptOssForCausalLM (eager attention, the experts' reference
loop): a tiny random model (GQA with head_dim free, biases, sinks, a window of 5 in alternate layers shorter than
the sequence, YaRN with and without truncate, the experts' clamp biting) imports with transformers' logits, exports
back bit for bit to a directory transformers loads with the same logits, and generates greedily as transformers
does (its cache keeps the window). MXFP4 experts (``*_blocks`` / ``*_scales``) dequantise as transformers does,
bit for bit, through import_from_hf and tools/convert_from_hf.py. What megazero cannot represent is refused."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the gpt-oss reference is transformers'")

from safetensors.torch import load_file, save_file  # noqa: E402
from transformers.integrations.mxfp4 import convert_moe_packed_tensors  # noqa: E402

from megazero.model import GPTModel  # noqa: E402
from megazero.model.config import GPTConfig  # noqa: E402
from megazero.model.interop.hf import config_from_hf, export_to_hf, hf_architecture, import_from_hf  # noqa: E402
from megazero.model.interop.mxfp4 import dequantize_mxfp4  # noqa: E402
from megazero.model.state_dict import gather_full_state_dict, load_full, load_full_state_dict  # noqa: E402

VOCAB, SEQ, WINDOW, LIMIT = 90, 20, 5, 0.5
YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=16)  # fewer positions than the sequence
ROPES = {"yarn": YARN, "yarn_truncate": {**YARN, "truncate": True},
         "default": {"rope_type": "default", "rope_theta": 150000.0}}
REFERENCE = dict(attn_implementation="eager", experts_implementation="eager")
MXFP4 = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}  # the Hub's


def hf_config(layers: int = 3, rope: dict | None = None, **kw):
    """hidden 64, 4 heads of 16 over 2 key/value heads, 4 experts of 64 top 2, layer_types alternating from
    sliding_attention (GptOssConfig's default); swiglu_limit 0.5 so the clamp bites."""
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=layers, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2, sliding_window=WINDOW,
                max_position_embeddings=64, swiglu_limit=LIMIT, rope_parameters=dict(rope or YARN))
    return transformers.GptOssConfig(**{**base, **kw}, **REFERENCE)


def random_hf(hf_dir=None, **kw):
    """A random transformers gpt-oss, every parameter moved off its init (biases and sinks nonzero)."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_config(**kw))
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


def _load_hf(hf_dir, **kw):
    return transformers.AutoModelForCausalLM.from_pretrained(str(hf_dir), **REFERENCE, **kw).eval()


@pytest.mark.parametrize("rope", list(ROPES))
def test_import_matches_transformers_and_exports_back_bit_for_bit(rope, tmp_path):
    hf = random_hf(tmp_path / "hf", rope=ROPES[rope])
    config, model = _ours(tmp_path / "hf")
    assert hf_architecture(config) == "gpt_oss"
    assert (config.window_size, [config.layer_window(i) for i in range(3)], config.softmax_type) == (
        (WINDOW - 1, 0), [WINDOW - 1, None, WINDOW - 1], "learnable")
    assert (config.activation, config.glu_linear_offset, config.activation_func_clamp_value, config.moe_router_bias,
            config.head_dim, config.query_groups) == ("quick_geglu", 1.0, LIMIT, True, 16, 2)
    if rope != "default":
        assert (config.rope_type, config.rotary_scaling_factor, config.original_max_position_embeddings,
                config.yarn_correction_range_round_to_int) == ("yarn", 4.0, 16, rope == "yarn_truncate")
    ids = _ids()
    with torch.no_grad():
        theirs = hf(ids).logits
        torch.testing.assert_close(model(ids)[..., :VOCAB], theirs, atol=1e-4, rtol=1e-4)

    assert export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back")) == "GptOssForCausalLM"
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert before.keys() == after.keys() and "model.layers.2.mlp.experts.gate_up_proj" in after
    assert all(torch.equal(before[k], after[k]) for k in before)
    saved = json.load(open(tmp_path / "back" / "config.json"))
    assert (saved["model_type"], saved["architectures"], saved["layer_types"], saved["sliding_window"],
            saved["swiglu_limit"], saved["num_local_experts"], saved["num_experts_per_tok"], saved["head_dim"]) == (
        "gpt_oss", ["GptOssForCausalLM"], ["sliding_attention", "full_attention", "sliding_attention"], WINDOW, LIMIT,
        4, 2, 16)
    assert saved["rope_parameters"] == {**ROPES[rope], **({"truncate": rope == "yarn_truncate"} if rope != "default"
                                                          else {})}
    assert "quantization_config" not in saved
    again, _ = import_from_hf(str(tmp_path / "back"), make_vocab_size_divisible_by=32)
    assert again == config  # the exported config.json reads back as the same model
    back = _load_hf(tmp_path / "back")
    assert type(back).__name__ == "GptOssForCausalLM"
    with torch.no_grad():
        torch.testing.assert_close(back(ids).logits, theirs, atol=0, rtol=0)


def test_greedy_generation_equals_transformers(tmp_path):
    """Past the window: transformers' generate (its cache, sliding layers keeping the last 5 keys) against
    megazero's forward over the whole sequence each step."""
    hf = random_hf(tmp_path)
    _, model = _ours(tmp_path)
    prompt = _ids()[:1, :6]
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        expected = hf.generate(prompt, max_new_tokens=10, do_sample=False, pad_token_id=0)[0, 6:]
        tokens = prompt
        for _ in range(10):
            tokens = torch.cat([tokens, model(tokens)[:, -1, :VOCAB].argmax(-1, keepdim=True)], dim=1)
    assert tokens[0, 6:].tolist() == expected.tolist()


def test_the_clamp_the_window_and_the_sinks_change_the_reference(tmp_path):
    """What the comparisons above check is in play at these weights: transformers' logits move without the
    experts' clamp, without the window and without the sinks."""
    hf = random_hf()
    ids = _ids()
    with torch.no_grad():
        ref = hf(ids).logits
        for layer in hf.model.layers:
            layer.mlp.experts.limit = 1e9
        unclamped = hf(ids).logits
        hf = random_hf(layer_types=["full_attention"] * 3)
        full = hf(ids).logits
        hf = random_hf()
        for layer in hf.model.layers:
            layer.self_attn.sinks.fill_(-1e4)
        sinkless = hf(ids).logits
    for other in (unclamped, full, sinkless):
        assert (other - ref).abs().max() > 1e-3


# ---- MXFP4 --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantisation_equals_transformers_bit_for_bit(dtype):
    """Random packed bytes and every exponent but the largest (2^128 overflows alike), in chunks of any size."""
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 40, 2, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(0, 255, (3, 40, 2), generator=g, dtype=torch.uint8)
    want = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    bits = torch.int32 if dtype == torch.float32 else torch.int16
    for chunk in (7, 1 << 20):
        got = dequantize_mxfp4(blocks, scales, dtype, rows_per_chunk=chunk)
        assert got.shape == want.shape == (3, 64, 40) and torch.equal(got.view(bits), want.view(bits))
    meta = dequantize_mxfp4(blocks.to("meta"), scales.to("meta"), dtype)
    assert meta.is_meta and meta.shape == want.shape and meta.dtype == dtype
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :1], dtype)


def _write_mxfp4(plain_dir, out_dir) -> dict[str, torch.Tensor]:
    """``plain_dir``'s checkpoint with random MXFP4 experts in place of its matrices (exponents 2^-9 .. 2^-2),
    the Hub's quantization_config in its config.json; returns the packed tensors."""
    g = torch.Generator().manual_seed(3)
    packed = {}
    for name, t in load_file(str(plain_dir / "model.safetensors")).items():
        if name.endswith(("gate_up_proj", "down_proj")):
            experts, rows_in, rows_out = t.shape
            packed[name + "_blocks"] = torch.randint(0, 256, (experts, rows_out, rows_in // 32, 16), generator=g,
                                                     dtype=torch.uint8)
            packed[name + "_scales"] = torch.randint(118, 126, (experts, rows_out, rows_in // 32), generator=g,
                                                     dtype=torch.uint8)
        else:
            packed[name] = t
    out_dir.mkdir()
    save_file(packed, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.load(open(plain_dir / "config.json"))
    json.dump({**config, "quantization_config": MXFP4}, open(out_dir / "config.json", "w"))
    return packed


def test_an_mxfp4_checkpoint_imports_as_transformers_dequantises_it(tmp_path):
    """import_from_hf and tools/convert_from_hf.py (layer by layer) give the experts transformers loads with
    Mxfp4Config(dequantize=True), bit for bit, and its logits; the export writes them plain."""
    from megazero.cli import convert_from_hf

    random_hf(tmp_path / "plain")
    packed = _write_mxfp4(tmp_path / "plain", tmp_path / "mxfp4")
    hf = _load_hf(tmp_path / "mxfp4", quantization_config=transformers.Mxfp4Config(dequantize=True),
                  dtype=torch.float32)
    experts = hf.model.layers[1].mlp.experts
    blocks = packed["model.layers.1.mlp.experts.gate_up_proj_blocks"]
    assert torch.equal(experts.gate_up_proj, convert_moe_packed_tensors(
        blocks, packed["model.layers.1.mlp.experts.gate_up_proj_scales"], dtype=torch.float32))
    config, model = _ours(tmp_path / "mxfp4")
    ids = _ids()
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :VOCAB], hf(ids).logits, atol=1e-4, rtol=1e-4)
    export_to_hf(gather_full_state_dict(model), config, str(tmp_path / "back"))
    plain = load_file(str(tmp_path / "back" / "model.safetensors"))
    for name, t in hf.state_dict().items():
        assert torch.equal(plain[name], t), name
    assert "quantization_config" not in json.load(open(tmp_path / "back" / "config.json"))

    assert convert_from_hf.main(["--input", str(tmp_path / "mxfp4"), "--output", str(tmp_path / "mz"),
                                 "--override", "make_vocab_size_divisible_by=32"]) == 0
    streamed_config, streamed = load_full(str(tmp_path / "mz"))
    assert streamed_config == config
    full = gather_full_state_dict(model)
    assert streamed.keys() == full.keys() and all(torch.equal(streamed[k], full[k]) for k in full)


# ---- what does not convert --------------------------------------------------------------------------------


def _hf_dict(**change) -> dict:
    return {**hf_config().to_dict(), **change}


@pytest.mark.parametrize("change, message", [
    (dict(layer_types=["sliding_attention", "chunked_attention", "full_attention"]), "layer_types"),
    (dict(swiglu_alpha=1.5), "swiglu_alpha=1.5"),
    (dict(attention_bias=False), "attention_bias=False"),
    (dict(quantization_config={"quant_method": "fp8"}), "quantization_config 'fp8'"),
    (dict(rope_parameters={**YARN, "attention_factor": 2.0}), "attention_factor=2.0"),
    (dict(rope_parameters={**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}), "mscale_all_dim"),
    (dict(rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}), "rope type 'dynamic'"),
])
def test_configs_megazero_cannot_represent_are_refused_in_one_line(change, message):
    with pytest.raises(ValueError, match=message) as e:
        config_from_hf(_hf_dict(**change))
    assert "\n" not in str(e.value)


def test_the_hubs_config_reads():
    """openai/gpt-oss-20b's config.json as published (transformers 4.x's rope_scaling beside rope_theta, the
    quantization_config), less its token ids: the recipe's model."""
    hub = {"architectures": ["GptOssForCausalLM"], "attention_bias": True, "attention_dropout": 0.0,
           "experts_per_token": 4, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
           "initial_context_length": 4096, "initializer_range": 0.02, "intermediate_size": 2880,
           "layer_types": ["sliding_attention", "full_attention"] * 12, "max_position_embeddings": 131072,
           "model_type": "gpt_oss", "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
           "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": False, "rms_norm_eps": 1e-05,
           "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                            "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
           "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
           "tie_word_embeddings": False, "use_cache": True, "vocab_size": 201088, "quantization_config": MXFP4}
    c = config_from_hf(hub)
    assert (c.num_layers, c.hidden_size, c.ffn_size, c.num_attention_heads, c.query_groups, c.head_dim,
            c.num_experts, c.moe_router_topk, c.window_size, c.rotary_base, c.rotary_scaling_factor,
            c.original_max_position_embeddings, c.yarn_correction_range_round_to_int, c.tie_embeddings,
            c.moe_aux_loss_coeff) == (24, 2880, 2880, 64, 8, 64, 32, 4, (127, 0), 150000.0, 32.0, 4096, False, False,
                                      0.9)
    assert [c.layer_window(i) for i in range(4)] == [127, None, 127, None]


def _gpt_oss(**kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                vocab_size=VOCAB, seq_length=16, max_position_embeddings=16, ffn_hidden_size=64,
                position_embedding_type="rope", normalization="rmsnorm", activation="quick_geglu",
                glu_linear_offset=1.0, activation_func_clamp_value=7.0, num_experts=4, moe_router_bias=True,
                softmax_type="learnable", tie_embeddings=False)
    return GPTConfig(**{**base, **kw}).validate()


@pytest.mark.parametrize("change, message", [
    (dict(softmax_type="vanilla"), "softmax_type='vanilla'"),
    (dict(activation_func_clamp_value=None), "activation_func_clamp_value=None"),
    (dict(glu_linear_offset=0.0), "glu_linear_offset=0.0"),
    (dict(moe_layer_freq=(1, 0)), "every gpt-oss layer is a mixture"),
    (dict(moe_router_bias=False, add_bias_linear=False), "add_bias_linear=False"),
    (dict(rope_type="yarn", rotary_scaling_factor=4.0, mscale_all_dim=1.0), "mscale_all_dim=1.0"),
    (dict(moe_shared_expert_intermediate_size=32), "moe_shared_expert_intermediate_size=32"),
])
def test_exports_gpt_oss_cannot_hold_are_refused(change, message):
    assert hf_architecture(_gpt_oss()) == "gpt_oss"
    with pytest.raises(ValueError, match=message):
        hf_architecture(_gpt_oss(**change))


def test_a_model_without_a_window_exports_with_every_layer_full(tmp_path):
    """transformers builds the sliding mask for any gpt-oss: the export gives it a window as long as the context,
    used by no layer, and the model runs as megazero's."""
    config = _gpt_oss()
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    export_to_hf(gather_full_state_dict(model), config, str(tmp_path))
    saved = json.load(open(tmp_path / "config.json"))
    assert (saved["layer_types"], saved["sliding_window"]) == (["full_attention"] * 2, 16)
    ids = _ids()[:, :16]
    with torch.no_grad():
        torch.testing.assert_close(_load_hf(tmp_path)(ids).logits, model(ids)[..., :VOCAB], atol=1e-4, rtol=1e-4)
