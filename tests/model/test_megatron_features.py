"""Megatron-LM model options: shapes equal to Megatron's, and each architecture
flag checked against a single-process reference and across tp 1/2."""

import math

import pytest
import torch
import torch.nn.functional as F

from megazero import mpu
from megazero.model import GPTConfig, GPTModel
from megazero.model.flops import num_parameters
from megazero.model.attention.rope import RotaryEmbedding, apply_rotary
from megazero.model.state_dict import gather_full_state_dict, gather_full_tensor, load_full_state_dict
from tests.distributed import run_distributed
from tests.helpers import assert_close
from tests.model.common import batch, mean_loss, tiny_config

SEED = 1234


# ---- shapes ------------------------------------------------------------------------------------


def test_swiglu_ffn_default_is_megatrons():
    c = GPTConfig(num_layers=1, hidden_size=4096, num_attention_heads=32, vocab_size=100, activation="swiglu")
    assert c.ffn_size == 10880
    assert c.replace(hidden_size=64, num_attention_heads=4).ffn_size == 128
    assert c.replace(activation="gelu").ffn_size == 4 * 4096
    assert c.replace(ffn_hidden_size=11008).ffn_size == 11008


def test_vocab_padding_multiplies_by_tp_like_megatron():
    gpt2 = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=50257)
    assert gpt2.padded_vocab_size == 50304
    assert gpt2.replace(vocab_padding_tp=4).padded_vocab_size == 50688
    # --make-vocab-size-divisible-by 2 --tp 4: pad to a multiple of 8 (refused before this)
    small = gpt2.replace(make_vocab_size_divisible_by=2, vocab_padding_tp=4)
    assert small.padded_vocab_size == 50264
    small.validate(4)
    with pytest.raises(ValueError, match="set vocab_padding_tp=4"):
        gpt2.replace(make_vocab_size_divisible_by=2).validate(4)  # 50258 % 4 != 0
    # weights padded for tp 4 load at tp 2 (the padded size divides)
    gpt2.replace(vocab_padding_tp=4).validate(2)


def test_kv_channels_sets_head_dim_independently():
    c = tiny_config("gpt", kv_channels=24)  # 8 heads x 24 = 192 != hidden 64
    assert c.head_dim == 24
    m = GPTModel(c)
    attn = m.layers[0].self_attention
    assert tuple(attn.linear_qkv.weight.shape) == (3 * 8 * 24, 64)
    assert tuple(attn.linear_proj.weight.shape) == (64, 8 * 24)
    assert num_parameters(m) == num_parameters(c)
    tiny_config("gpt", hidden_size=60, kv_channels=8).validate()  # 60 % 8 heads != 0 is fine with kv_channels
    with pytest.raises(ValueError, match="or set kv_channels"):
        tiny_config("gpt", hidden_size=60).validate()


def test_feature_fields_validate():
    with pytest.raises(ValueError, match="rotary_percent=0.5 needs position_embedding_type='rope'"):
        tiny_config("gpt", rotary_percent=0.5).validate()
    with pytest.raises(ValueError, match="rotary_percent must be in"):
        tiny_config("llama", rotary_percent=0.0).validate()
    with pytest.raises(ValueError, match="init_method='kaiming'"):
        tiny_config("gpt", init_method="kaiming").validate()
    with pytest.raises(ValueError, match="activation='relu'"):
        tiny_config("gpt", activation="relu").validate()
    c = tiny_config("llama", rotary_percent=0.5, qk_layernorm=True, apply_layernorm_1p=True, kv_channels=12,
                    init_method="xavier_uniform", fp32_residual_connection=True, activation="squared_relu",
                    apply_query_key_layer_scaling=True, vocab_padding_tp=2)
    assert GPTConfig.from_dict(c.to_dict()) == c


# ---- single-process references -------------------------------------------------------------------


def test_partial_rotary_rotates_only_the_leading_dims():
    x = torch.randn(5, 2, 3, 16)
    pos = torch.arange(5)
    cos, sin = RotaryEmbedding(8)(pos)  # rotary_percent 0.5 of d=16
    out = apply_rotary(x, cos, sin)
    assert torch.equal(out[..., 8:], x[..., 8:])
    assert_close(out[..., :8], apply_rotary(x[..., :8].contiguous(), cos, sin), "rotated half")
    assert not torch.allclose(out[..., :8], x[..., :8])
    m = GPTModel(tiny_config("llama", rotary_percent=0.5))
    assert m.rotary.dim == 4  # head dim 8 x 0.5


def _logits(model, ids):
    model.eval()
    with torch.no_grad():
        return model(ids)


def test_layernorm_1p_is_the_same_function_with_shifted_weights():
    for arch in ("gpt", "llama"):
        base = tiny_config(arch)
        torch.manual_seed(SEED)
        ref = GPTModel(base)
        torch.manual_seed(SEED)
        onep = GPTModel(base.replace(apply_layernorm_1p=True))
        assert float(onep.layers[0].input_layernorm.weight.detach().abs().max()) == 0.0  # stored gamma - 1 starts at 0
        ids, _ = batch(base)
        assert_close(_logits(onep, ids), _logits(ref, ids), f"1p init ({arch})", atol=0, rtol=0)
        # a trained-looking gamma: 1p stores gamma - 1
        sd = gather_full_state_dict(ref)
        g = torch.Generator().manual_seed(3)
        sd = {k: (v + 0.1 * torch.randn(v.shape, generator=g) if "norm" in k and k.endswith("weight") else v)
              for k, v in sd.items()}
        load_full_state_dict(ref, sd)
        load_full_state_dict(onep, {k: (v - 1 if "norm" in k and k.endswith("weight") else v) for k, v in sd.items()})
        assert_close(_logits(onep, ids), _logits(ref, ids), f"1p trained ({arch})")


def test_squared_relu_mlp():
    c = tiny_config("gpt", activation="squared_relu")
    torch.manual_seed(SEED)
    mlp = GPTModel(c).layers[0].mlp
    x = torch.randn(4, 2, 64)
    w1, b1 = mlp.linear_fc1.weight, mlp.linear_fc1.bias
    w2, b2 = mlp.linear_fc2.weight, mlp.linear_fc2.bias
    expected = F.linear(torch.relu(F.linear(x, w1, b1)) ** 2, w2, b2)
    assert_close(mlp(x).detach(), expected.detach(), "squared relu MLP")


def test_no_position_embedding_equals_learned_with_zero_table():
    torch.manual_seed(SEED)
    learned = GPTModel(tiny_config("gpt"))
    none = GPTModel(tiny_config("gpt", position_embedding_type="none"))
    assert none.position_embeddings is None and none.rotary is None
    sd = gather_full_state_dict(learned)
    load_full_state_dict(none, {k: v for k, v in sd.items() if k != "position_embeddings.weight"})
    with torch.no_grad():
        learned.position_embeddings.weight.zero_()
    ids, _ = batch(tiny_config("gpt"))
    assert_close(_logits(none, ids), _logits(learned, ids), "no position embedding", atol=0, rtol=0)


def test_qk_layernorm_normalizes_each_head():
    c = tiny_config("llama", qk_layernorm=True, kv_channels=16)
    torch.manual_seed(SEED)
    attn = GPTModel(c).layers[0].self_attention
    assert tuple(attn.q_layernorm.weight.shape) == (16,)
    seen = {}
    attn.q_layernorm.register_forward_hook(lambda m, i, o: seen.update(q=(i[0], o)) and None)
    attn(torch.randn(6, 2, 64))
    x, out = seen["q"]
    assert x.shape[-2:] == (8, 16)  # [s, b, heads, head_dim]: each head on its own
    expected = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + c.layernorm_epsilon)
    assert_close(out, expected, "per-head RMSNorm of q")


def test_xavier_uniform_init():
    torch.manual_seed(SEED)
    m = GPTModel(tiny_config("gpt", init_method="xavier_uniform"))
    for name in ("layers.0.self_attention.linear_qkv.weight", "layers.0.mlp.linear_fc2.weight", "embedding.weight"):
        w = dict(m.named_parameters())[name].detach()
        bound = math.sqrt(6.0 / (w.shape[0] + w.shape[1]))
        assert float(w.abs().max()) <= bound
        assert abs(float(w.std()) - bound / math.sqrt(3)) < 0.1 * bound, name  # U(-a, a) has std a/sqrt(3)


def test_fp32_residual_connection_keeps_the_stream_in_fp32():
    c = tiny_config("llama", params_dtype=torch.bfloat16, fp32_residual_connection=True)
    torch.manual_seed(SEED)
    m = GPTModel(c)
    dtypes = []
    m.layers[0].register_forward_hook(lambda mod, i, o: dtypes.append(o.dtype) and None)
    ids, labels = batch(c)
    loss = m(ids, labels=labels)
    assert dtypes == [torch.float32] and torch.isfinite(loss).all()
    torch.manual_seed(SEED)
    m32 = GPTModel(c.replace(params_dtype=torch.float32))
    ref = m32(ids, labels=labels).detach()
    plain = GPTModel(c.replace(fp32_residual_connection=False))
    load_full_state_dict(plain, gather_full_state_dict(m))
    err_fp32_res = float((loss.detach() - ref).abs().mean())
    err_plain = float((plain(ids, labels=labels).detach() - ref).abs().mean())
    assert err_fp32_res <= err_plain  # closer to the fp32 model (or equal)
    # fp32 weights: the flag changes nothing
    torch.manual_seed(SEED)
    m32b = GPTModel(c.replace(params_dtype=torch.float32, fp32_residual_connection=False))
    assert torch.equal(m32b(ids, labels=labels).detach(), ref)


def test_query_key_layer_scaling_is_a_noop():
    ids, _ = batch(tiny_config("gpt"))
    torch.manual_seed(SEED)
    a = _logits(GPTModel(tiny_config("gpt")), ids)
    torch.manual_seed(SEED)
    b = _logits(GPTModel(tiny_config("gpt", apply_query_key_layer_scaling=True)), ids)
    assert torch.equal(a, b)


# ---- tp 1 vs tp 2 ---------------------------------------------------------------------------------

FEATURES = [
    ("gpt", dict(kv_channels=12, activation="squared_relu", init_method="xavier_uniform")),
    ("gpt", dict(position_embedding_type="none", apply_layernorm_1p=True, sequence_parallel=True)),
    ("llama", dict(rotary_percent=0.5, qk_layernorm=True, sequence_parallel=True)),
    ("llama", dict(qk_layernorm=True, apply_layernorm_1p=True, kv_channels=16, fp32_residual_connection=True,
                   apply_query_key_layer_scaling=True)),
    ("gpt", dict(qk_layernorm=True, vocab_padding_tp=2, make_vocab_size_divisible_by=3)),
]


def _run(model, ids, labels):
    loss = model(ids, labels=labels)
    mean_loss(loss, labels).backward()
    return loss.detach(), {n: gather_full_tensor(p.grad, p, model.tp_group) for n, p in model.named_parameters()}


def _features_parity(tp):
    refs = []
    for arch, kw in FEATURES:
        config = tiny_config(arch, **kw)
        ids, labels = batch(config)
        torch.manual_seed(SEED)
        ref = GPTModel(config)
        with torch.no_grad():  # move norm weights off their init so qk/1p norms matter
            for n, p in ref.named_parameters():
                if "norm" in n:
                    p.add_(0.05 * torch.arange(p.numel(), dtype=p.dtype).reshape(p.shape) / p.numel())
        refs.append((config, ids, labels, gather_full_state_dict(ref), *_run(ref, ids, labels)))
    mpu.initialize_model_parallel(tp)
    worst = 0.0
    for (config, ids, labels, weights, ref_loss, ref_grads), (arch, kw) in zip(refs, FEATURES):
        model = GPTModel(config)
        load_full_state_dict(model, weights)
        loss, grads = _run(model, ids, labels)
        worst = max(worst, assert_close(loss, ref_loss, f"loss at tp={tp} {kw}"))
        for k, g in grads.items():
            worst = max(worst, assert_close(g, ref_grads[k], f"grad of {k} at tp={tp} {kw}"))
    return worst


def test_features_match_tp1_at_tp2():
    worst = run_distributed(2, _features_parity, 2)
    assert max(worst) < 1e-5
