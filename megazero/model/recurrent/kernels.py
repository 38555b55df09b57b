"""The chunked scans on CUDA: flash-linear-attention's gated delta rule and mamba-ssm's SSD scan where installed.

A run of a scan (``sequence.Scan.run``) calls :func:`gated_delta_rule` or :func:`ssd_scan`. On CUDA tensors, with
the package importable and working, they call its fused kernels (as ``attention/core.py`` calls flash-attn);
otherwise, and for whatever a kernel does not take, megazero's PyTorch chunked forms (``delta_rule.py``,
``ssd.py``), which are the reference the kernels are checked against. Both return the state a run leaves in
fp32. flash-linear-attention takes packed documents only as cu_seqlens, whose lengths would have to be read on
the host in every layer: a run with document starts keeps the PyTorch form. mamba-ssm takes them as
``seq_idx``, computed on the device.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import torch

from .delta_rule import chunk_gated_delta_rule
from .ssd import chunk_ssd_scan

__all__ = ["gated_delta_rule", "ssd_scan", "fla_gated_delta_rule", "mamba_chunk_scan"]


@functools.lru_cache(maxsize=None)
def fla_gated_delta_rule() -> Optional[Callable]:
    """flash-linear-attention's ``chunk_gated_delta_rule`` (None when it cannot be imported)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_rule
    except Exception:  # not installed, or built for another CUDA/torch
        return None
    return fla_rule


@functools.lru_cache(maxsize=None)
def mamba_chunk_scan() -> Optional[Callable]:
    """mamba-ssm's ``mamba_chunk_scan_combined`` (None when it cannot be imported)."""
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    except Exception:
        return None
    return mamba_chunk_scan_combined


def _fused_device(t: torch.Tensor) -> bool:
    """Whether ``t`` lives where the fused kernels run (CUDA)."""
    return t.is_cuda


def gated_delta_rule(q, k, v, g, beta, *, initial_state=None, starts=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked gated delta rule (``delta_rule.chunk_gated_delta_rule``'s contract): flash-linear-attention's
    kernel on CUDA without document starts, else megazero's."""
    fused = fla_gated_delta_rule() if _fused_device(q) and starts is None else None
    if fused is None:
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, starts=starts)
    o, final = fused(q, k, v, g.float(), beta, scale=q.size(-1) ** -0.5, initial_state=initial_state,
                     output_final_state=True)
    return o.to(v.dtype), final.float()


def ssd_scan(x, dt, A, B, C, *, D=None, initial_state=None, starts=None,
             chunk_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """The chunked SSD scan (``ssd.chunk_ssd_scan``'s contract): mamba-ssm's kernel on CUDA, packed documents as
    its ``seq_idx`` (a start at t = 0 drops the initial state, as megazero's form does), else megazero's."""
    fused = mamba_chunk_scan() if _fused_device(x) else None
    if fused is None:
        return chunk_ssd_scan(x, dt, A, B, C, D=D, initial_state=initial_state, starts=starts, chunk_size=chunk_size)
    seq_idx = None
    if starts is not None:
        seq_idx = (torch.cumsum(starts.to(torch.int32), dim=1) - starts[:, :1].to(torch.int32)).to(torch.int32)
        if initial_state is not None:
            initial_state = initial_state * (~starts[:, 0]).to(initial_state.dtype)[:, None, None, None]
    y, final = fused(x, dt, A, B, C, chunk_size, D=D, initial_states=initial_state, seq_idx=seq_idx,
                     return_final_states=True)
    return y.to(x.dtype), final.float()
