"""The safetensors header's dtype codes and the torch dtypes they name (one table for every reader and writer)."""

from __future__ import annotations

import torch

__all__ = ["DTYPE_OF_CODE", "CODE_OF_DTYPE", "FLOAT_CODES"]

DTYPE_OF_CODE: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}
CODE_OF_DTYPE: dict[torch.dtype, str] = {dtype: code for code, dtype in DTYPE_OF_CODE.items()}
FLOAT_CODES = ("F64", "F32", "F16", "BF16")  # what weights, masters and optimizer states are stored as
