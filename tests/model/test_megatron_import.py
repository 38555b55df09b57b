"""Megatron-LM / Megatron-DeepSpeed checkpoints: detection with a conversion hint, safe loading,
and import at tp 2 / pp 2, checked against a plain forward of the same Megatron weights."""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megazero.model import GPTModel
from megazero.model.state_dict import load_full, load_full_state_dict
from megazero.checkpoint.megatron_legacy import detect_foreign_checkpoint, load_megatron_file

REPO = Path(__file__).resolve().parents[2]
L, H, HEADS, SEQ, VOCAB = 2, 32, 4, 8, 64  # padded vocab 64 = 8 x tp 2 x ... (divisible_by 8)


def _tool():
    spec = importlib.util.spec_from_file_location("cfm", REPO / "tools" / "convert_from_megatron.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    return m


def _args(kind, tp, pp):
    common = dict(num_layers=L, hidden_size=H, num_attention_heads=HEADS, seq_length=SEQ, max_position_embeddings=SEQ,
                  padded_vocab_size=VOCAB, make_vocab_size_divisible_by=8, tensor_model_parallel_size=tp,
                  pipeline_model_parallel_size=pp, hidden_dropout=0.0, attention_dropout=0.0, kv_channels=H // HEADS,
                  virtual_pipeline_model_parallel_size=None)
    if kind == "gpt":
        return argparse.Namespace(**common, ffn_hidden_size=4 * H, position_embedding_type="learned_absolute",
                                  normalization="LayerNorm", swiglu=False, add_bias_linear=True,
                                  untie_embeddings_and_output_weights=False, group_query_attention=False)
    return argparse.Namespace(**common, ffn_hidden_size=48, position_embedding_type="rope", rotary_base=10000,
                              normalization="RMSNorm", swiglu=True, add_bias_linear=False, norm_epsilon=1e-6,
                              untie_embeddings_and_output_weights=True, group_query_attention=True, num_query_groups=2)


def _full_megatron_weights(a):
    """Random full (tp=1) weights under Megatron's names and layouts."""
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g) * 0.2  # noqa: E731
    groups = getattr(a, "num_query_groups", None) if a.group_query_attention else HEADS
    d = H // HEADS
    qkv = (HEADS + 2 * groups) * d
    f = a.ffn_hidden_size
    bias = a.add_bias_linear
    w = {"embedding.word_embeddings.weight": r(VOCAB, H)}
    if a.position_embedding_type == "learned_absolute":
        w["embedding.position_embeddings.weight"] = r(SEQ, H)
    for i in range(L):
        p = f"encoder.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + r(H)
        w[p + "self_attention.query_key_value.weight"] = r(qkv, H)
        w[p + "self_attention.dense.weight"] = r(H, HEADS * d)
        w[p + "post_attention_layernorm.weight"] = 1 + r(H)
        w[p + "mlp.dense_h_to_4h.weight"] = r(2 * f if a.swiglu else f, H)
        w[p + "mlp.dense_4h_to_h.weight"] = r(H, f)
        if a.normalization == "LayerNorm":
            w[p + "input_layernorm.bias"], w[p + "post_attention_layernorm.bias"] = r(H), r(H)
        if bias:
            for n, size in (("self_attention.query_key_value", qkv), ("self_attention.dense", H),
                            ("mlp.dense_h_to_4h", f), ("mlp.dense_4h_to_h", H)):
                w[p + n + ".bias"] = r(size)
    w["encoder.final_layernorm.weight"] = 1 + r(H)
    if a.normalization == "LayerNorm":
        w["encoder.final_layernorm.bias"] = r(H)
    if a.untie_embeddings_and_output_weights:
        w["output_layer.weight"] = r(VOCAB, H)
    return w, groups


def _shard(name, t, rank, tp, a, groups):
    if tp == 1:
        return t
    if "query_key_value" in name:
        return t.reshape(groups, -1, *t.shape[1:]).chunk(tp)[rank].reshape(-1, *t.shape[1:])
    if "dense_h_to_4h" in name:
        if a.swiglu:
            gate, up = t.chunk(2)
            return torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
        return t.chunk(tp)[rank]
    if name.endswith(("dense.weight", "dense_4h_to_h.weight")):
        return t.chunk(tp, dim=1)[rank]
    if "word_embeddings" in name or name == "output_layer.weight":
        return t.chunk(tp)[rank]
    return t


def _nest(flat):
    """Megatron legacy nesting: model['language_model'][embedding|encoder|output_layer]."""
    lm = {"embedding": {}, "encoder": {}}
    for k, v in flat.items():
        if k.startswith("embedding."):
            part, _, leaf = k[len("embedding."):].partition(".")
            lm["embedding"].setdefault(part, {})[leaf] = v
        elif k.startswith("encoder."):
            lm["encoder"][k[len("encoder."):]] = v
        elif k == "output_layer.weight":
            lm["output_layer"] = {"weight": v}
    return {"language_model": lm}


def _rng_state():
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "rng_tracker_states": {}}]


def write_megatron_lm(root, a, full, groups, iteration=100):
    tp, pp = a.tensor_model_parallel_size, a.pipeline_model_parallel_size
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))
    per = L // pp
    for t in range(tp):
        for p in range(pp):
            flat = {}
            for k, v in full.items():
                m = k.startswith("encoder.layers.") and int(k.split(".")[2])
                if k.startswith("encoder.layers."):
                    if p * per <= m < (p + 1) * per:
                        flat[k.replace(f"layers.{m}.", f"layers.{m - p * per}.", 1)] = _shard(k, v, t, tp, a, groups)
                elif k.startswith("embedding.") and p == 0:
                    flat[k] = _shard(k, v, t, tp, a, groups)
                elif (k.startswith("encoder.final") or k == "output_layer.weight") and p == pp - 1:
                    flat[k] = _shard(k, v, t, tp, a, groups)
            model = _nest(flat)
            if p == pp - 1 and pp > 1 and not a.untie_embeddings_and_output_weights:
                model["word_embeddings_for_head"] = {"weight": _shard("word_embeddings", full["embedding.word_embeddings.weight"], t, tp, a, groups)}
            d = root / f"iter_{iteration:07d}" / (f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""))
            d.mkdir(parents=True)
            torch.save({"args": a, "checkpoint_version": 3.0, "iteration": iteration, "model": model,
                        "rng_state": _rng_state()}, d / "model_optim_rng.pt")


def write_megatron_deepspeed(root, a, full, groups, step=7):
    tp = a.tensor_model_parallel_size
    (root / "latest").write_text(f"global_step{step}")
    d = root / f"global_step{step}"
    d.mkdir(parents=True)
    for t in range(tp):
        emb = {"word_embeddings.weight": _shard("word_embeddings", full["embedding.word_embeddings.weight"], t, tp, a, groups)}
        if "embedding.position_embeddings.weight" in full:
            emb["position_embeddings.weight"] = full["embedding.position_embeddings.weight"]
        torch.save(emb, d / f"layer_01-model_{t:02d}-model_states.pt")
        for i in range(L):
            pre = f"encoder.layers.{i}."
            layer = {k[len(pre):]: _shard(k, v, t, tp, a, groups) for k, v in full.items() if k.startswith(pre)}
            torch.save(layer, d / f"layer_{i + 3:02d}-model_{t:02d}-model_states.pt")
        norm = {k.rsplit(".", 1)[1]: v for k, v in full.items() if k.startswith("encoder.final_layernorm")}
        torch.save(norm, d / f"layer_{L + 4:02d}-model_{t:02d}-model_states.pt")
        if a.untie_embeddings_and_output_weights:  # LMHeadPipe
            head = {"lm_head.weight": _shard("output_layer.weight", full["output_layer.weight"], t, tp, a, groups)}
            torch.save(head, d / f"layer_{L + 5:02d}-model_{t:02d}-model_states.pt")
        else:
            torch.save(emb, d / f"layer_{L + 5:02d}-model_{t:02d}-model_states.pt")  # tied output: same tensor
        torch.save({"module": None, "args": a, "dp_world_size": 1}, d / f"mp_rank_{t:02d}_model_states.pt")


def reference_logits(a, full, groups, ids):
    """Megatron's forward written out plainly (eval, no dropout) from the Megatron weights."""
    d = H // HEADS
    per = HEADS // groups
    eps = getattr(a, "norm_epsilon", 1e-5)
    ln = a.normalization == "LayerNorm"
    s = ids.shape[1]

    def norm(x, p):
        if ln:
            return F.layer_norm(x, (H,), full[p + ".weight"], full[p + ".bias"], eps)
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * full[p + ".weight"]

    def lin(x, p):
        return F.linear(x, full[p + ".weight"], full.get(p + ".bias"))

    x = full["embedding.word_embeddings.weight"][ids]
    if "embedding.position_embeddings.weight" in full:
        x = x + full["embedding.position_embeddings.weight"][:s]
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.arange(s).float()[:, None] * inv
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    rot = lambda t: t * cos + torch.cat([-t[..., d // 2:], t[..., : d // 2]], -1) * sin  # noqa: E731
    for i in range(L):
        p = f"encoder.layers.{i}."
        qkv = lin(norm(x, p + "input_layernorm"), p + "self_attention.query_key_value")
        qkv = qkv.view(*qkv.shape[:2], groups, per + 2, d)
        q = qkv[..., :per, :].reshape(*qkv.shape[:2], HEADS, d)
        k = qkv[..., per, :].repeat_interleave(per, dim=2)
        v = qkv[..., per + 1, :].repeat_interleave(per, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [b, heads, s, d]
        if a.position_embedding_type == "rope":
            q, k = rot(q), rot(k)
        scores = q @ k.transpose(-1, -2) / math.sqrt(d)
        scores = scores.masked_fill(torch.ones(s, s, dtype=torch.bool).triu(1), float("-inf"))
        ctx = (scores.softmax(-1) @ v).transpose(1, 2).reshape(*x.shape[:2], HEADS * d)
        x = x + lin(ctx, p + "self_attention.dense")
        h = lin(norm(x, p + "post_attention_layernorm"), p + "mlp.dense_h_to_4h")
        if a.swiglu:
            gate, up = h.chunk(2, -1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")  # Megatron's bias-gelu fusion (its default) is the tanh form
        x = x + lin(h, p + "mlp.dense_4h_to_h")
    x = norm(x, "encoder.final_layernorm")
    out = full.get("output_layer.weight", full["embedding.word_embeddings.weight"])
    return x @ out.t()


@pytest.mark.parametrize("kind, tp, pp, layout", [("gpt", 2, 1, "lm"), ("llama", 2, 2, "lm"), ("gpt", 1, 2, "lm"),
                                                  ("gpt", 2, 1, "ds"), ("llama", 2, 1, "ds")])
def test_import_matches_megatron_forward(tmp_path, kind, tp, pp, layout):
    a = _args(kind, tp, pp)
    full, groups = _full_megatron_weights(a)
    src = tmp_path / "megatron"
    src.mkdir()
    (write_megatron_lm if layout == "lm" else write_megatron_deepspeed)(src, a, full, groups)
    assert _tool().main(["--input", str(src), "--output", str(tmp_path / "mz")]) == 0
    config, sd = load_full(str(tmp_path / "mz"))
    model = GPTModel(config.replace(attention_backend="math")).eval()
    load_full_state_dict(model, sd)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = model(ids)
    ref = reference_logits(a, full, groups, ids)
    torch.testing.assert_close(ours, ref, atol=2e-5, rtol=2e-5)


def test_detects_megatron_formats(tmp_path):
    a = _args("gpt", 2, 2)
    full, groups = _full_megatron_weights(a)
    lm = tmp_path / "lm"
    lm.mkdir()
    write_megatron_lm(lm, a, full, groups)
    msg = detect_foreign_checkpoint(str(lm))
    assert "Megatron-LM checkpoint (legacy mp_rank_XX format, tp=2, pp=2)" in msg and "convert_from_megatron.py" in msg
    ds = tmp_path / "ds"
    ds.mkdir()
    write_megatron_deepspeed(ds, _args("gpt", 2, 1), full, groups)
    assert "Megatron-DeepSpeed" in detect_foreign_checkpoint(str(ds))
    dist_ckpt = tmp_path / "dist"
    (dist_ckpt / "iter_0000050").mkdir(parents=True)
    (dist_ckpt / "latest_checkpointed_iteration.txt").write_text("50")
    (dist_ckpt / "iter_0000050" / ".metadata").write_bytes(b"")
    (dist_ckpt / "iter_0000050" / "common.pt").write_bytes(b"")
    assert detect_foreign_checkpoint(str(dist_ckpt)) is None  # torch_dist is read as it is (checkpoint.torch_dist)
    own = tmp_path / "own"
    (own / "iter_0000010").mkdir(parents=True)
    (own / "latest").write_text("iter_0000010")
    assert detect_foreign_checkpoint(str(own)) is None  # megazero's own layout
    assert detect_foreign_checkpoint(str(tmp_path / "missing")) is None


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_loading_is_allow_listed(tmp_path):
    import enum

    class ModelType(enum.Enum):
        encoder_or_decoder = 1

    ModelType.__module__ = "megatron.core.enums"
    ModelType.__qualname__ = "ModelType"
    import sys
    import types

    names = ("megatron", "megatron.core", "megatron.core.enums")
    # An earlier test may have imported the real megatron-core: stand it aside while the fakes pickle.
    real = {k: sys.modules.pop(k) for k in list(sys.modules) if k == "megatron" or k.startswith("megatron.")}
    for n in names:
        sys.modules[n] = types.ModuleType(n)
    sys.modules["megatron.core.enums"].ModelType = ModelType
    try:  # pickled as Megatron pickles args.model_type
        torch.save({"args": argparse.Namespace(model_type=ModelType.encoder_or_decoder), "w": torch.ones(1)},
                   tmp_path / "ok.pt")
    finally:
        for n in names:
            del sys.modules[n]
        sys.modules.update(real)
    loaded = load_megatron_file(str(tmp_path / "ok.pt"))  # megatron not importable: an inert placeholder
    assert torch.equal(loaded["w"], torch.ones(1)) and type(loaded["args"].model_type).__name__ == "ModelType"
    torch.save({"x": Evil()}, tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="posix.system|os.system|nt.system"):
        load_megatron_file(str(tmp_path / "evil.pt"))
