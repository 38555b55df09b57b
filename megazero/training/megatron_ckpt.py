"""Recognize checkpoints written by Megatron-LM or Megatron-DeepSpeed, and read them safely.

``detect_foreign_checkpoint(path)`` tells a ``--load`` directory that megazero cannot
resume (instead of silently "starting from scratch") and says how to convert it.
``load_megatron_file`` reads one Megatron ``.pt`` file with ``torch.load(weights_only=True)``
and an explicit allow-list: ``argparse.Namespace``, the numpy types of saved RNG states,
and inert placeholder classes for Megatron/DeepSpeed enums found in saved ``args``
(e.g. ``ModelType.encoder_or_decoder``), so no code from the checkpoint ever runs and
Megatron need not be installed. Anything else is refused by name.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
from typing import Any, Optional

import torch

__all__ = ["detect_foreign_checkpoint", "load_megatron_file", "CONVERT_HINT"]

CONVERT_HINT = "python tools/convert_from_megatron.py --input {path} --output DIR, then train with --pretrained-checkpoint DIR"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def detect_foreign_checkpoint(path: str) -> Optional[str]:
    """A message naming the Megatron format of ``path`` and how to convert it, or None
    when ``path`` is not a Megatron-LM / Megatron-DeepSpeed checkpoint directory."""
    if not path or not os.path.isdir(path):
        return None
    hint = CONVERT_HINT.format(path=path)
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    iteration_dir = path
    if os.path.isfile(tracker):
        it = _read(tracker)
        iteration_dir = os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}" if it.isdigit() else it)
    if os.path.isfile(os.path.join(iteration_dir, ".metadata")) or os.path.isfile(os.path.join(iteration_dir, "common.pt")):
        return (f"{path} is a Megatron-LM torch_dist (distributed) checkpoint, which megazero cannot load. "
                f"Convert it to Megatron's legacy format with Megatron-LM itself (run its training once with "
                f"--load {path} --ckpt-convert-format torch --ckpt-convert-save LEGACY_DIR), then: "
                + CONVERT_HINT.format(path="LEGACY_DIR"))
    ranks = sorted(glob.glob(os.path.join(iteration_dir, "mp_rank_*")))
    if ranks:
        names = [os.path.basename(r) for r in ranks]
        tp = len({n[8:10] for n in names})
        pp = len({n[11:14] for n in names}) if all(len(n) > 10 for n in names) else 1
        return (f"{path} is a Megatron-LM checkpoint (legacy mp_rank_XX format, tp={tp}, pp={pp}) that megazero "
                f"cannot resume; import its weights with: {hint}")
    latest = _read(os.path.join(path, "latest"))
    steps = glob.glob(os.path.join(path, "global_step*"))
    if re.fullmatch(r"global_step\d+", latest) or (steps and not latest.startswith("iter_")):
        return (f"{path} is a Megatron-DeepSpeed (DeepSpeed engine) checkpoint ({latest or os.path.basename(steps[0])}) "
                f"that megazero cannot resume; import its weights with: {hint}")
    if re.fullmatch(r"global_step\d+", os.path.basename(os.path.normpath(path))) and (
            glob.glob(os.path.join(path, "*model_states.pt"))):
        return f"{path} is one step of a Megatron-DeepSpeed checkpoint; import its weights with: {hint}"
    return None


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
