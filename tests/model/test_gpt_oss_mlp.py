"""gpt-oss's MLP and mixture of experts (quick GEGLU with a linear offset and a clamp, biases on every linear
and on the router's logits, the softmax over the top k logits) against transformers' GptOssExperts and
GptOssMLP with the same weights (HF's interleaved gate_up_proj taken apart: ::2 the gate, 1::2 the up):
output and every gradient within 1e-5 in fp32, with inputs large enough that the clamp bites; and the
activation against megatron-core's quick GEGLU."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the gpt-oss reference is transformers'")

from transformers.models.gpt_oss import modeling_gpt_oss as hf_oss  # noqa: E402

from megazero.model.config import GPTConfig  # noqa: E402
from megazero.model.init import init_methods  # noqa: E402
from megazero.model.mlp import MLP  # noqa: E402
from megazero.model.moe.layer import AuxLossScale, MoELayer  # noqa: E402

H, F, E, K = 16, 24, 4, 2
LIMIT = 7.0
TOL = dict(rtol=1e-5, atol=1e-5)


def _config(**kw) -> GPTConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, seq_length=8, max_position_embeddings=8,
                vocab_size=32, ffn_hidden_size=F, activation="quick_geglu", glu_linear_offset=1.0,
                activation_func_clamp_value=LIMIT, add_bias_linear=True, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTConfig(**{**base, **kw}).validate()


def _hf_config(experts: int):
    cfg = transformers.GptOssConfig(hidden_size=H, intermediate_size=F, num_local_experts=experts,
                                    num_experts_per_tok=min(K, experts), num_attention_heads=2, num_key_value_heads=1,
                                    head_dim=8, num_hidden_layers=1, vocab_size=32, swiglu_limit=LIMIT)
    cfg._experts_implementation = "eager"  # the reference loop over experts, as written in modeling_gpt_oss
    return cfg


def _random(module: torch.nn.Module, seed: int) -> None:
    """Weights of std 0.5 on inputs of std 2: fc1's outputs reach well past the clamp."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _copy_expert(mlp: MLP, experts, e: int) -> None:
    """HF expert ``e`` into megazero's MLP: gate_up_proj ``[h, 2f]`` interleaved (gate 0, up 0, gate 1, ...)
    -> fc1 ``[gate; up]`` ``[2f, h]``; down_proj ``[f, h]`` -> fc2 ``[h, f]``."""
    gate_up, bias = experts.gate_up_proj[e], experts.gate_up_proj_bias[e]
    with torch.no_grad():
        mlp.linear_fc1.weight.copy_(torch.cat([gate_up[:, ::2].t(), gate_up[:, 1::2].t()]))
        mlp.linear_fc1.bias.copy_(torch.cat([bias[::2], bias[1::2]]))
        mlp.linear_fc2.weight.copy_(experts.down_proj[e].t())
        mlp.linear_fc2.bias.copy_(experts.down_proj_bias[e])


def _expert_grads(mlp: MLP) -> tuple[torch.Tensor, ...]:
    """megazero's gradients in HF's layout (interleaved again)."""
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    gate_up = torch.stack([fc1.weight.grad[:F].t(), fc1.weight.grad[F:].t()], dim=-1).reshape(H, 2 * F)
    bias = torch.stack([fc1.bias.grad[:F], fc1.bias.grad[F:]], dim=-1).reshape(2 * F)
    return gate_up, bias, fc2.weight.grad.t(), fc2.bias.grad


def _assert_expert_grads(mlp: MLP, experts, e: int) -> None:
    want = (experts.gate_up_proj.grad[e], experts.gate_up_proj_bias.grad[e], experts.down_proj.grad[e],
            experts.down_proj_bias.grad[e])
    for name, got, ref in zip(("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
                              _expert_grads(mlp), want):
        torch.testing.assert_close(got, ref, **TOL, msg=lambda m: f"expert {e} {name}: {m}")


def _inputs(seed: int, tokens: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, 1, H, generator=g) * 2, torch.randn(tokens, 1, H, generator=g)


def test_dense_mlp_equals_a_gpt_oss_expert():
    """One HF expert with routing weight 1 is a dense MLP: megazero's, built from the same flags' config."""
    experts = hf_oss.GptOssExperts(_hf_config(1))
    _random(experts, 1)
    mlp = MLP(_config(), tp_group=None, tp_size=1)
    _copy_expert(mlp, experts, 0)
    x, grad = _inputs(2)
    fc1 = torch.nn.functional.linear(x, mlp.linear_fc1.weight, mlp.linear_fc1.bias)
    assert (fc1[..., :F] > LIMIT).any() and (fc1[..., F:] < -LIMIT).any() and (fc1[..., F:] > LIMIT).any()
    xh, xm = x.reshape(-1, H).clone().requires_grad_(), x.clone().requires_grad_()
    ones = torch.ones(xh.size(0), 1)
    want = experts(xh, torch.zeros(xh.size(0), 1, dtype=torch.long), ones)
    got = mlp(xm)
    torch.testing.assert_close(got.reshape(-1, H), want, **TOL)
    want.backward(grad.reshape(-1, H))
    got.backward(grad)
    torch.testing.assert_close(xm.grad.reshape(-1, H), xh.grad, **TOL)
    _assert_expert_grads(mlp, experts, 0)


def _moe(config: GPTConfig) -> MoELayer:
    return MoELayer(config, lambda: MLP(config, tp_group=None, tp_size=1, expert=True), tp_group=None, tp_size=1,
                    ep_group=None, ep_size=1, ep_rank=0, aux_scale=AuxLossScale(), init_method=init_methods(config)[0])


@pytest.mark.parametrize("grouped", [False, True])
def test_mixture_equals_gpt_oss_mlp(grouped):
    """Router (weight and bias, top 2 of the logits then their softmax) and experts against GptOssMLP; with
    ``moe_grouped_gemm`` the experts run as grouped matmuls with their biases added per expert's rows."""
    hf = hf_oss.GptOssMLP(_hf_config(E))
    _random(hf, 3)
    c = _config(num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=F, moe_router_bias=True,
                moe_router_load_balancing_type="none", moe_grouped_gemm=grouped)
    layer = _moe(c)
    with torch.no_grad():
        layer.router.weight.copy_(hf.router.weight)
        layer.router.bias.copy_(hf.router.bias)
    for e in range(E):
        _copy_expert(layer.experts[str(e)], hf.experts, e)
    x, grad = _inputs(4, tokens=24)
    xh, xm = x.transpose(0, 1).clone().requires_grad_(), x.clone().requires_grad_()  # HF: [b, s, h]
    want, _ = hf(xh)
    got = layer(xm)
    assert layer.experts.grouped(xm.reshape(-1, H)) == grouped
    torch.testing.assert_close(got.transpose(0, 1), want, **TOL)
    want.backward(grad.transpose(0, 1))
    got.backward(grad)
    torch.testing.assert_close(xm.grad.transpose(0, 1), xh.grad, **TOL)
    torch.testing.assert_close(layer.router.weight.grad, hf.router.weight.grad, **TOL)
    torch.testing.assert_close(layer.router.bias.grad, hf.router.bias.grad, **TOL)
    assert hf.router.bias.grad.abs().max() > 1e-3  # the bias moves the routing weights
    for e in range(E):
        _assert_expert_grads(layer.experts[str(e)], hf.experts, e)


def test_router_takes_the_softmax_of_the_top_k_logits_with_their_bias():
    """GptOssTopKRouter: top k of x W^T + b, then the softmax over those k (not over all experts)."""
    hf = hf_oss.GptOssTopKRouter(_hf_config(E))
    _random(hf, 5)
    layer = _moe(_config(num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=F, moe_router_bias=True,
                         moe_router_load_balancing_type="none"))
    with torch.no_grad():
        layer.router.weight.copy_(hf.weight)
        layer.router.bias.copy_(hf.bias)
    x, _ = _inputs(6)
    tokens = x.reshape(-1, H)
    _, scores, indices = hf(tokens)
    routing = layer.router(tokens, 1)
    order = torch.argsort(routing.top, dim=-1)  # the k experts in any order
    assert torch.equal(routing.top.gather(1, order), indices.sort(-1).values)
    torch.testing.assert_close(routing.weights.gather(1, order), scores.gather(1, indices.sort(-1).indices),
                               rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("offset,clamp", [(0.0, None), (1.0, 7.0), (0.5, 0.3)])
def test_quick_geglu_equals_megatron_cores_glu(offset, clamp):
    """megatron-core's unfused MLP activation for quick_gelu with glu_linear_offset and
    activation_func_clamp_value (transformer/mlp.py's ``glu``), on the same [gate; up] tensor."""
    pytest.importorskip("megatron.core")
    from megatron.core.fusions.fused_bias_geglu import quick_gelu

    quick_gelu = quick_gelu.__wrapped__  # the function itself, not its torch.compile'd kernel (1 ulp apart)

    mlp = MLP(_config(glu_linear_offset=offset, activation_func_clamp_value=clamp), tp_group=None, tp_size=1)
    h = torch.randn(6, 2 * F, generator=torch.Generator().manual_seed(7)) * 4

    def glu(x):  # megatron.core.transformer.mlp.MLP.forward's, as written there
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if clamp is not None:
            x_glu = x_glu.clamp(min=None, max=clamp)
            x_linear = x_linear.clamp(min=-clamp, max=clamp)
        return quick_gelu(x_glu) * (x_linear + offset)

    torch.testing.assert_close(mlp._act(h), glu(h), rtol=0, atol=0)


def test_defaults_keep_swiglu_and_the_router_as_they_were():
    """Off, the options change nothing: SwiGLU is silu(gate) * up bit for bit and the router has no bias."""
    c = _config(activation="swiglu", glu_linear_offset=0.0, activation_func_clamp_value=None, num_experts=E,
                moe_ffn_hidden_size=F)
    h = torch.randn(6, 2 * F, generator=torch.Generator().manual_seed(8))
    gate, up = h.chunk(2, dim=-1)
    assert torch.equal(MLP(c, tp_group=None, tp_size=1)._act(h), torch.nn.functional.silu(gate) * up)
    assert _moe(c).router.bias is None and "router.bias" not in dict(_moe(c).named_parameters())


def test_a_clamped_swiglu_clamps_as_megatron():
    """--swiglu --activation-func-clamp-value (DeepSeek-V4's, GLM's): silu(min(gate, c)) * clamp(up, -c, c)."""
    mlp = MLP(_config(activation="swiglu", glu_linear_offset=0.0, activation_func_clamp_value=2.0),
              tp_group=None, tp_size=1)
    h = torch.randn(6, 2 * F, generator=torch.Generator().manual_seed(9)) * 4
    gate, up = h.chunk(2, dim=-1)
    want = torch.nn.functional.silu(gate.clamp(max=2.0)) * up.clamp(-2.0, 2.0)
    torch.testing.assert_close(mlp._act(h), want, rtol=0, atol=0)


@pytest.mark.parametrize("kw,message", [
    (dict(activation="gelu"), "gated MLP"),
    (dict(activation="squared_relu", activation_func_clamp_value=None), "gated MLP"),
    (dict(activation_func_clamp_value=0.0), "must be > 0"),
    (dict(moe_router_bias=True), "needs num_experts"),
])
def test_bad_combinations_are_refused(kw, message):
    with pytest.raises(ValueError, match=message):
        _config(**kw)


@pytest.mark.parametrize("mtp", [0, 1])
def test_the_closed_forms_count_the_router_bias_and_the_gated_experts(mtp):
    """num_parameters / replicated_parameters / expert_parameters of a gpt-oss-shaped config equal the built
    model's (the router's bias replicated over TP like its weight, fc1 [gate; up] twice as wide). The routed
    experts are counted apart (sharded over etp x ep), their fc2 biases among them."""
    from megazero.model import GPTModel
    from megazero.model.flops import expert_parameters, num_parameters, replicated_parameters

    c = _config(num_layers=2, num_experts=E, moe_router_topk=K, moe_ffn_hidden_size=F, moe_router_bias=True,
                moe_layer_freq=(0, 1), moe_shared_expert_intermediate_size=F, moe_shared_expert_gate=True,
                mtp_num_layers=mtp, position_embedding_type="rope", normalization="rmsnorm")
    model = GPTModel(c, device="meta")
    assert num_parameters(c) == num_parameters(model)
    assert replicated_parameters(c) == sum(p.numel() for n, p in model.named_parameters()
                                           if not getattr(p, "tensor_model_parallel", False) and ".experts." not in n)
    assert expert_parameters(c) == sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert sum(1 for n, _ in model.named_parameters() if n.endswith("router.bias")) == 1 + mtp


def test_megatron_lm_arguments_carry_the_activation_both_ways():
    """A torch_dist save writes Megatron-LM's spelling (quick_geglu, glu_linear_offset,
    activation_func_clamp_value) and reading those arguments gives the same model back."""
    import argparse

    from megazero.model.interop.megatron_args import megatron_model_args
    from megazero.model.interop.megatron_import import config_from_megatron_args

    c = _config(num_experts=E, moe_ffn_hidden_size=F)
    args = megatron_model_args(c)
    assert (args["quick_geglu"], args["swiglu"], args["glu_linear_offset"], args["activation_func_clamp_value"]) == \
        (True, False, 1.0, LIMIT)
    back = config_from_megatron_args(argparse.Namespace(**args))
    assert (back.activation, back.glu_linear_offset, back.activation_func_clamp_value) == ("quick_geglu", 1.0, LIMIT)
    plain = config_from_megatron_args(argparse.Namespace(**megatron_model_args(_config(
        activation="gelu", glu_linear_offset=0.0, activation_func_clamp_value=None))))
    assert (plain.activation, plain.glu_linear_offset, plain.activation_func_clamp_value) == ("gelu", 0.0, None)


def test_gpt_oss_parts_export_as_gpt_oss_only():
    """A Llama-shaped config with any of gpt-oss's MLP or router settings is no Llama: only HF's gpt-oss has them,
    and the export names what keeps it from being one."""
    from megazero.model.interop.hf import hf_architecture

    llama = dict(position_embedding_type="rope", normalization="rmsnorm", activation="swiglu", glu_linear_offset=0.0,
                 activation_func_clamp_value=None, add_bias_linear=False)
    assert hf_architecture(_config(**llama)) == "llama"
    for change in (dict(glu_linear_offset=1.0), dict(activation_func_clamp_value=7.0), dict(activation="quick_geglu")):
        with pytest.raises(ValueError, match=r"only gpt-oss \(GptOssForCausalLM\) has, and is not representable"):
            hf_architecture(_config(**{**llama, **change}))
    with pytest.raises(ValueError, match="moe_router_bias=True.*activation='swiglu' \\(gpt-oss needs 'quick_geglu'\\)"):
        hf_architecture(_config(**llama, num_experts=E, moe_ffn_hidden_size=F, moe_router_bias=True))
