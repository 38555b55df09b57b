"""Reading one Megatron-LM / DeepSpeed ``.pt`` file without running code from it.

:func:`load_megatron_file` is ``torch.load(weights_only=True)`` with an explicit allow-list:
``argparse.Namespace``, the numpy types of saved RNG states, and inert placeholder classes for
Megatron/DeepSpeed enums found in saved ``args`` (e.g. ``ModelType.encoder_or_decoder``), so no
code from the checkpoint ever runs and Megatron need not be installed. Anything else is refused
by name. The legacy readers (``megatron_ckpt``) and the torch_dist reader (``common.pt``) use it.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

__all__ = ["load_megatron_file"]


def _placeholder(module: str, name: str) -> type:
    """An inert stand-in for a class named in a checkpoint (an enum in saved args)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.args, self.kwargs = args, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    cls = type(name, (), {"__init__": __init__, "__setstate__": __setstate__,
                          "__repr__": lambda self: f"<{module}.{name} {self.args}>"})
    cls.__module__, cls.__qualname__ = module, name
    return cls


def _numpy_globals() -> list:
    import numpy as np

    core = getattr(np, "_core", None) or np.core
    out = [core.multiarray._reconstruct, np.ndarray, np.dtype]
    dtypes = getattr(np, "dtypes", None)
    if dtypes is not None:
        out += [getattr(dtypes, n) for n in dir(dtypes) if n.endswith("DType")]
    return out


_PLACEHOLDER_PREFIXES = ("megatron.", "deepspeed.")


def load_megatron_file(path: str) -> dict:
    """``torch.load(path, weights_only=True)`` with the allow-list described above."""
    unsafe = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    allowed = [argparse.Namespace] + _numpy_globals()
    allowed_names = {f"{g.__module__}.{getattr(g, '__qualname__', g.__name__)}" for g in allowed}
    refused = []
    for full in unsafe:
        if full in allowed_names:
            continue
        module, _, name = full.rpartition(".")
        if full.startswith(_PLACEHOLDER_PREFIXES):
            allowed.append(_placeholder(module, name))
        else:
            refused.append(full)
    if refused:
        raise ValueError(f"{path} contains Python objects outside megazero's allow-list: {refused}; refusing to "
                         f"unpickle them (only tensors, argparse.Namespace, numpy RNG state and Megatron enums are read)")
    with torch.serialization.safe_globals(allowed):
        return torch.load(path, map_location="cpu", weights_only=True)
