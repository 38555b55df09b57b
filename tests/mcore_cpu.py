"""megatron-core on CPU gloo ranks: what its CUDA-minded code needs to run there, entered in the spawned ranks only.

* :func:`cpu_shims`: the save and load paths' CUDA helpers (synchronize, the current device, the RNG tracker's
  CUDA generators) and two placeholders an install without Transformer Engine leaves behind.
* :func:`cpu_optimizer_shims`: the distributed optimizer's ``device='cuda'`` tensors and ``.cuda()`` calls made
  on the CPU, and its ``torch.cuda.FloatTensor`` type test of the parameters it wraps answered for CPU ones.
* :class:`MLACoreAttention`, :func:`grouped_gemm_shim`, :func:`let_grouped_experts_run_fp32`: torch stand-ins for
  the Transformer Engine / grouped_gemm kernels of multi-latent attention's and the grouped experts' specs.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.overrides import TorchFunctionMode

__all__ = ["cpu_shims", "cpu_optimizer_shims", "MLACoreAttention", "grouped_gemm_shim", "let_grouped_experts_run_fp32"]


def cpu_shims() -> None:
    """megatron-core's save and load call CUDA helpers that have CPU meanings (in the spawned ranks only)."""
    from megatron.core.tensor_parallel import random as mcore_random

    torch.cuda.synchronize = lambda *a, **k: None
    torch.cuda.current_device = lambda: "cpu"
    # The tracker's CUDA generators do not exist on CPU; dropout then draws from the CPU generator.
    mcore_random.CudaRNGStatesTracker.fork = contextlib.contextmanager(lambda self, name=None: (yield))
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):  # the router's matmul names it whether or not TE imported
        moe_utils.te_general_gemm = None
    from megatron.core.transformer import multi_latent_attention as mla

    if not isinstance(mla.TELinear, type):  # without TE a placeholder, which MLA's isinstance() refuses
        mla.TELinear = type("NoTELinear", (), {})

class _CudaMeansCpu(TorchFunctionMode):
    """Tensors asked for on ``cuda`` are made on the CPU, and ``.cuda()`` leaves a tensor where it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.Tensor.cuda:
            return args[0]
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        return func(*args, **kwargs)


@contextlib.contextmanager
def cpu_optimizer_shims() -> Iterator[None]:
    """megatron-core's DistributedOptimizer on CPU: ``device='cuda'`` and ``.cuda()`` mean the CPU, and a CPU float
    tensor's ``type()`` answers as its CUDA twin's does (``torch.cuda.FloatTensor``), which its wrapping code asks
    for."""
    plain_type = torch.Tensor.type

    def cuda_type(self, *args, **kwargs):
        name = plain_type(self, *args, **kwargs)
        if args or kwargs or ".cuda." in name:
            return name
        return name.replace("torch.", "torch.cuda.", 1)

    torch.Tensor.type = cuda_type
    try:
        with _CudaMeansCpu():
            yield
    finally:
        torch.Tensor.type = plain_type

class MLACoreAttention(torch.nn.Module):
    """Softmax attention with query/key heads of one width and value heads of another: what MLA's spec asks of
    its core attention (Transformer Engine's there; the local DotProductAttention has one head width)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, softmax_scale=None, k_channels=None,
                 **unused):
        super().__init__()  # (the base Attention builds one without the widths; MLA then replaces it)
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or 1) ** -0.5

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, packed_seq_params=None, **unused):
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        scores = torch.matmul(q, k.transpose(-1, -2)) * self.softmax_scale
        s_q, s_k = scores.shape[-2:]
        causal = torch.ones(s_q, s_k, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(causal if attention_mask is None else attention_mask | causal, float("-inf"))
        out = torch.matmul(torch.softmax(scores.float(), dim=-1).to(v.dtype), v)  # [b, n, s, dv]
        return out.permute(2, 0, 1, 3).reshape(s_q, q.shape[0], -1)

def _gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """The grouped_gemm package's ``ops.gmm`` as a loop: rows of ``a`` in groups of ``batch_sizes`` times b[e]."""
    rows = torch.split(a, [int(n) for n in batch_sizes.tolist()])
    return torch.cat([r @ (b[e].t() if trans_b else b[e]) for e, r in enumerate(rows)])


def grouped_gemm_shim() -> None:
    """megatron-core's GroupedMLP (the local spec's grouped experts) wants the grouped_gemm package (CUDA);
    its one kernel, written in torch, stands in on CPU."""
    import types

    from megatron.core.transformer.moe import grouped_gemm_util as gg

    gg.grouped_gemm_is_available = lambda: True
    gg.assert_grouped_gemm_is_available = lambda: None
    gg.ops = types.SimpleNamespace(gmm=_gmm)

def let_grouped_experts_run_fp32(model) -> None:
    """GroupedMLP's forward asserts bf16 for its CUDA kernel; the torch stand-in runs fp32 weights as they are."""
    import copy

    from megatron.core.transformer.moe.experts import GroupedMLP

    for module in model.modules():
        if isinstance(module, GroupedMLP):
            module.config = copy.copy(module.config)
            module.config.bf16 = True
