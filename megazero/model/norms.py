"""LayerNorm and RMSNorm that are safe under sequence parallelism.

Under sequence parallelism a norm sees only this rank's ``s/tp`` tokens, so the
gradient of its (replicated) weight is partial. Passing the weight through
``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward)
makes autograd sum it over TP, exactly as the row-parallel bias does; the params
are also marked ``sequence_parallel=True`` for optimizers that want to know.

apex's fused kernels are used on CUDA inputs when apex and its CUDA extension import
(decided once per process, when the first norm is built); torch's otherwise.

``apply_layernorm_1p`` (Megatron's LayerNorm1P): the parameter stores ``gamma - 1`` and
starts at zero; the norm multiplies by ``weight + 1``. Input in a wider dtype than the
weights (the fp32 residual stream of ``fp32_residual_connection``) is normalized in fp32
and returned in the weights' dtype, as Megatron's mixed fused LayerNorm does.
"""

from __future__ import annotations

import functools
import importlib
from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero.mpu.mappings import copy_to_tensor_model_parallel_region

__all__ = ["LayerNorm", "RMSNorm", "build_norm"]


@functools.lru_cache(maxsize=None)
def _apex_fns() -> tuple:
    """apex's fused ``(layer_norm_affine, rms_norm_affine)``, or ``(None, None)`` for torch's kernels.

    apex's Python module imports without its CUDA extension and would only fail at the first
    CUDA forward, so the extension (``fused_layer_norm_cuda``) is imported too. Decided once
    per process (the cache): later calls (every norm module's construction) reuse the answer.
    """
    try:
        from apex.normalization.fused_layer_norm import fused_layer_norm_affine, fused_rms_norm_affine

        importlib.import_module("fused_layer_norm_cuda")  # what those functions call into
        return fused_layer_norm_affine, fused_rms_norm_affine
    except Exception:  # apex absent, or built without its CUDA extensions
        return None, None


class _Norm(torch.nn.Module):
    """Shared plumbing: the weight (and bias) parameters and their SP marking."""

    def __init__(self, hidden_size: int, eps: float, *, bias: bool, sequence_parallel: bool,
                 tp_group: Optional[dist.ProcessGroup], params_dtype: torch.dtype, device=None,
                 one_plus: bool = False) -> None:
        super().__init__()
        self.hidden_size, self.eps, self.one_plus = hidden_size, eps, one_plus
        self.sequence_parallel, self.tp_group = sequence_parallel, tp_group
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))
        self.bias = (torch.nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device))
                     if bias else None)
        for p in self.parameters(recurse=False):
            p.sequence_parallel = sequence_parallel

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.weight.fill_(0.0 if self.one_plus else 1.0)
            if self.bias is not None:
                self.bias.zero_()

    def _affine(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        w, b = self.weight, self.bias
        if self.sequence_parallel:
            w = copy_to_tensor_model_parallel_region(w, self.tp_group)
            b = None if b is None else copy_to_tensor_model_parallel_region(b, self.tp_group)
        if self.one_plus:
            w = w + 1
        return w, b

    def extra_repr(self) -> str:
        return f"{self.hidden_size}, eps={self.eps}, sequence_parallel={self.sequence_parallel}"


class LayerNorm(_Norm):
    def __init__(self, hidden_size: int, eps: float = 1e-5, **kw) -> None:
        super().__init__(hidden_size, eps, bias=True, **kw)
        self._fused = _apex_fns()[0]  # None: torch's kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self._affine()
        if x.dtype != w.dtype:  # fp32 residual stream, low-precision weights
            out = F.layer_norm(x.float(), (self.hidden_size,), w.float(), None if b is None else b.float(), self.eps)
            return out.to(w.dtype)
        if self._fused is not None and x.is_cuda:
            return self._fused(x, w, b, (self.hidden_size,), self.eps)
        return F.layer_norm(x, (self.hidden_size,), w, b, self.eps)


class RMSNorm(_Norm):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 like Llama's."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, **kw) -> None:
        super().__init__(hidden_size, eps, bias=False, **kw)
        self._fused = _apex_fns()[1]  # None: torch's kernel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w, _ = self._affine()
        if self._fused is not None and x.is_cuda and x.dtype == w.dtype:
            return self._fused(x, w, (self.hidden_size,), self.eps)
        # Normalize in fp32 (as HF Llama does), then scale in the parameter dtype.
        y = F.rms_norm(x.float(), (self.hidden_size,), None, self.eps).to(w.dtype)
        return y * w


def build_norm(config, *, tp_group: Optional[dist.ProcessGroup], tp_size: int, device=None,
               size: Optional[int] = None, partial_grads: Optional[bool] = None) -> _Norm:
    """The norm chosen by ``config.normalization``, SP-aware when sequence parallelism is active.

    ``size`` overrides the normalized width (the head dimension for qk-layernorm);
    ``partial_grads`` says each TP rank sees only part of the inputs, so the weight gradient
    must be summed over TP (default: sequence parallelism at tp > 1).
    """
    cls = LayerNorm if config.normalization == "layernorm" else RMSNorm
    partial = config.sequence_parallel and tp_size > 1 if partial_grads is None else partial_grads
    return cls(size or config.hidden_size, config.layernorm_epsilon, sequence_parallel=partial,
               tp_group=tp_group, params_dtype=config.params_dtype, device=device,
               one_plus=config.apply_layernorm_1p)
