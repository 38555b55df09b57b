"""MXFP4 expert weights (OCP microscaling FP4, as gpt-oss's Hub checkpoints store their experts), dequantised.

A ``*_blocks`` tensor ``[E, rows, G, 16]`` (uint8) packs two E2M1 values a byte, the low nibble first, 32 values
per block; ``*_scales`` ``[E, rows, G]`` (uint8) holds each block's power of two, E8M0 with bias 127. Value j of a
row is ``FP4[nibble j] * 2 ** (scale - 127)``. The result is ``[E, G * 32, rows]``, the layout of transformers'
``GptOssExperts`` (``gate_up_proj [E, hidden, 2 * ffn]``, ``down_proj [E, ffn, hidden]``).

:func:`dequantize_mxfp4` repeats transformers' ``integrations.mxfp4.convert_moe_packed_tensors`` operation for
operation (the same table, the same ``ldexp`` in the same dtype), so the weights are those transformers loads, bit
for bit; transformers is not needed. Rows are converted in chunks to bound the temporaries (the arithmetic is per
row, so the chunking changes no value).
"""

from __future__ import annotations

import torch

__all__ = ["FP4_VALUES", "dequantize_mxfp4"]

# E2M1: sign, two exponent bits, one mantissa bit; index = the nibble.
FP4_VALUES = (+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
                     rows_per_chunk: int = 1 << 20) -> torch.Tensor:
    """``[E, rows, G, 16]`` packed blocks and ``[E, rows, G]`` exponents -> ``[E, G * 32, rows]`` in ``dtype``.
    Meta tensors in, a meta tensor of the result's shape out (the streaming converters' dry run)."""
    if blocks.dim() != 4 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match: "
                         "expected [experts, rows, groups, 16] and [experts, rows, groups]")
    experts, rows, groups, width = blocks.shape
    if blocks.is_meta or scales.is_meta:
        return torch.empty(experts, groups * width * 2, rows, dtype=dtype, device="meta")
    blocks = blocks.to(torch.uint8).reshape(-1, width)
    exponents = (scales.to(torch.int32) - _SCALE_BIAS).reshape(-1, 1)
    lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
    out = torch.empty(blocks.shape[0], width * 2, dtype=dtype, device=blocks.device)
    for r0 in range(0, blocks.shape[0], rows_per_chunk):
        blk, sub = blocks[r0:r0 + rows_per_chunk], out[r0:r0 + rows_per_chunk]
        sub[:, 0::2] = lut[(blk & 0x0F).to(torch.int)]
        sub[:, 1::2] = lut[(blk >> 4).to(torch.int)]
        torch.ldexp(sub, exponents[r0:r0 + rows_per_chunk], out=sub)
    return out.view(experts, rows, groups * width * 2).transpose(1, 2).contiguous()
