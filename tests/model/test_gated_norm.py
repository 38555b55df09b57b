"""gated_rms_norm against transformers' own gated norms, bit for bit: Qwen3-Next's Qwen3NextRMSNormGated
(norm before gate) and Nemotron-H's NemotronHRMSNormGated (gate before a grouped norm), in fp32 and bf16, with
the weight in the input's dtype and in fp32, forward and backward."""

from __future__ import annotations

import pytest
import torch

from megazero.model.recurrent.gated_norm import gated_rms_norm

transformers = pytest.importorskip("transformers", reason="the gated norms are checked against transformers")
from transformers.models.nemotron_h.configuration_nemotron_h import NemotronHConfig  # noqa: E402
from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHRMSNormGated  # noqa: E402
from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig  # noqa: E402
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated  # noqa: E402

C = 48
DTYPES = [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)]


def _inputs(dtype: torch.dtype, weight_dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(3, 5, C, generator=g) * 2).to(dtype)
    z = torch.randn(3, 5, C, generator=g).to(dtype)
    w = (1 + 0.3 * torch.randn(C, generator=g)).to(weight_dtype)
    return x, z, w


def _grads(out: torch.Tensor, *tensors: torch.Tensor) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    cot = torch.randn(out.shape, generator=g).to(out.dtype)
    return list(torch.autograd.grad(out, tensors, cot))


def test_default_eps_of_the_two_families():
    """The eps each family's config hands its gated norm; callers pass these."""
    assert Qwen3NextConfig().rms_norm_eps == 1e-6
    assert NemotronHConfig().layer_norm_epsilon == 1e-5


@pytest.mark.parametrize("dtype,weight_dtype", DTYPES)
def test_norm_before_gate_is_qwen3_next(dtype, weight_dtype):
    eps = Qwen3NextConfig().rms_norm_eps
    x, z, w = _inputs(dtype, weight_dtype)
    ref_mod = Qwen3NextRMSNormGated(C, eps=eps).to(weight_dtype)
    with torch.no_grad():
        ref_mod.weight.copy_(w)
    xr, zr = x.clone().requires_grad_(), z.clone().requires_grad_()
    ref = ref_mod(xr, zr)
    xo, zo, wo = x.clone().requires_grad_(), z.clone().requires_grad_(), w.clone().requires_grad_()
    out = gated_rms_norm(xo, zo, wo, eps=eps, norm_before_gate=True)
    assert out.dtype == dtype == ref.dtype
    assert torch.equal(out, ref)
    for a, b in zip(_grads(out, xo, zo, wo), _grads(ref, xr, zr, ref_mod.weight)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype,weight_dtype", DTYPES)
@pytest.mark.parametrize("n_groups", [1, 4])
def test_gate_before_grouped_norm_is_nemotron_h(dtype, weight_dtype, n_groups):
    eps = NemotronHConfig().layer_norm_epsilon
    x, z, w = _inputs(dtype, weight_dtype, seed=1)
    ref_mod = NemotronHRMSNormGated(C, group_size=C // n_groups, eps=eps).to(weight_dtype)
    with torch.no_grad():
        ref_mod.weight.copy_(w)
    xr, zr = x.clone().requires_grad_(), z.clone().requires_grad_()
    ref = ref_mod(xr, zr)
    xo, zo, wo = x.clone().requires_grad_(), z.clone().requires_grad_(), w.clone().requires_grad_()
    group = None if n_groups == 1 else C // n_groups
    out = gated_rms_norm(xo, zo, wo, eps=eps, group_size=group, norm_before_gate=False)
    # transformers returns the promoted dtype (fp32 for an fp32 weight) and its mixer casts to the model dtype.
    assert out.dtype == dtype
    assert torch.equal(out, ref.to(dtype))
    if ref.dtype == dtype:  # the same graph: the gradients agree bit for bit too
        for a, b in zip(_grads(out, xo, zo, wo), _grads(ref, xr, zr, ref_mod.weight)):
            assert torch.equal(a, b)


def test_groups_normalise_separately():
    """A grouped norm is the whole-width norm of each group on its own, and both are the formula evaluated in
    float64 (independent of transformers) up to fp32 rounding: the norm computes in fp32 whatever the input."""
    x, z, w = _inputs(torch.float32, torch.float32, seed=2)
    out = gated_rms_norm(x, z, w, eps=1e-5, group_size=12, norm_before_gate=False)
    x64, z64, w64 = x.double(), z.double(), w.double()
    for k in range(0, C, 12):
        sl = slice(k, k + 12)
        part = gated_rms_norm(x[..., sl], z[..., sl], w[sl], eps=1e-5, norm_before_gate=False)
        torch.testing.assert_close(out[..., sl], part, rtol=1e-6, atol=1e-6)
        h = x64[..., sl] * torch.nn.functional.silu(z64[..., sl])
        by_hand = h / torch.sqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w64[sl]
        torch.testing.assert_close(out[..., sl].double(), by_hand, rtol=1e-6, atol=1e-6)
    h = x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-6) * w64 * torch.nn.functional.silu(z64)
    out = gated_rms_norm(x, z, w, eps=1e-6, norm_before_gate=True)
    torch.testing.assert_close(out.double(), h, rtol=1e-6, atol=1e-6)


def test_bad_shapes_are_refused():
    x, z, w = _inputs(torch.float32, torch.float32)
    with pytest.raises(ValueError, match="must divide"):
        gated_rms_norm(x, z, w, eps=1e-5, group_size=7, norm_before_gate=False)
    with pytest.raises(ValueError, match="weight"):
        gated_rms_norm(x, z, w[:-1], eps=1e-5, norm_before_gate=True)
