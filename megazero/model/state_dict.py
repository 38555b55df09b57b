"""Full (tp=1-shaped) state dicts from TP shards and back, plus a simple on-disk format.

A full state dict has exactly the keys and shapes of a tp=1 model, so checkpoints
move between TP sizes and to/from Hugging Face. Shards are contiguous chunks
along ``partition_dim``; a ``partition_stride`` of k (SwiGLU's fused [gate; up])
means the full tensor is k logical blocks, each chunked over ranks, and rank r
holds ``[block_0 chunk r; ...; block_{k-1} chunk r]``.

On disk (``save_full`` / ``load_full``): a directory with ``model_full.safetensors``
and ``config.json`` (``GPTConfig.to_dict()``).
"""

from __future__ import annotations

import json
import math
import os
import re
import struct
from collections.abc import Mapping
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megazero.mpu.mappings import resolve_tp_group
from megazero.mpu.sharding import full_from_shards, shard_of_full
from megazero.mpu.utils import group_rank, group_size
from megazero.utils.safetensors_dtypes import CODE_OF_DTYPE

from .config import GPTConfig

__all__ = ["gather_full_tensor", "shard_full_tensor", "gather_full_state_dict", "load_full_state_dict",
           "save_full", "load_full", "FULL_WEIGHTS_NAME", "CONFIG_NAME"]

FULL_WEIGHTS_NAME = "model_full.safetensors"
CONFIG_NAME = "config.json"


def _layout(param: torch.Tensor) -> tuple[bool, int, int]:
    return (bool(getattr(param, "tensor_model_parallel", False)), int(getattr(param, "partition_dim", 0)),
            int(getattr(param, "partition_stride", 1)))


def _group(model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    if tp_group is not None:
        return tp_group
    # A GPTModel knows its group (None = built without TP); other modules use the registered one.
    return model.tp_group if hasattr(model, "tp_group") else resolve_tp_group(None)


def _size_rank(group) -> tuple[int, int]:
    return group_size(group), group_rank(group)


def gather_full_tensor(local: torch.Tensor, param: torch.Tensor, tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """All-gather ``local`` (a shard shaped like ``param``, e.g. its grad) into the full tensor.

    Replicated parameters come back as they are. Collective: every TP rank must call it.
    """
    sharded, dim, stride = _layout(param)
    world, _ = _size_rank(tp_group)
    if not sharded or world == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(parts, local.contiguous(), group=tp_group)
    return full_from_shards(parts, dim, stride)


def shard_full_tensor(full: torch.Tensor, param: torch.Tensor, tp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
    """This rank's shard of ``full`` for ``param`` (inverse of ``gather_full_tensor``)."""
    sharded, dim, stride = _layout(param)
    world, rank = _size_rank(tp_group)
    if not sharded or world == 1:
        return full
    return shard_of_full(full, dim, stride, rank, world)


def _full_shape(param: torch.Tensor, world: int) -> tuple[int, ...]:
    sharded, dim, _ = _layout(param)
    shape = list(param.shape)
    if sharded:
        shape[dim] *= world
    return tuple(shape)


def gather_full_state_dict(model: torch.nn.Module, tp_group: Optional[dist.ProcessGroup] = None) -> dict[str, torch.Tensor]:
    """The model's weights with TP shards all-gathered: keys and shapes of a tp=1 model.

    Collective over the TP group; the result is returned on *every* TP rank (detached
    copies, on the parameters' device).
    """
    group = _group(model, tp_group)
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        out[name] = gather_full_tensor(t.detach(), t, group).clone()
    return out


@torch.no_grad()
def load_full_state_dict(model: torch.nn.Module, full_sd: dict[str, torch.Tensor],
                         tp_group: Optional[dist.ProcessGroup] = None) -> None:
    """Copy this rank's slice of every tensor in the full (tp=1-shaped) ``full_sd`` into ``model``.

    Strict: raises KeyError listing missing and unexpected keys, ValueError listing shape
    mismatches, before anything is modified. No communication.
    """
    group = _group(model, tp_group)
    world, _ = _size_rank(group)
    own = model.state_dict(keep_vars=True)
    missing, unexpected = sorted(set(own) - set(full_sd)), sorted(set(full_sd) - set(own))
    if missing or unexpected:
        raise KeyError(f"full state dict does not match the model: missing keys {missing}, unexpected keys {unexpected}")
    bad = [f"{k}: checkpoint {tuple(full_sd[k].shape)} vs model {_full_shape(t, world)}"
           for k, t in own.items() if tuple(full_sd[k].shape) != _full_shape(t, world)]
    if bad:
        raise ValueError("full state dict shapes do not match the model (full, tp=1 shapes): " + "; ".join(bad))
    for k, t in own.items():
        t.copy_(shard_full_tensor(full_sd[k], t, group).to(dtype=t.dtype, device=t.device))


def save_full(out_dir: str, full_sd: dict[str, torch.Tensor], config: GPTConfig) -> None:
    """Write ``model_full.safetensors`` + ``config.json`` into ``out_dir``."""
    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.detach().cpu().contiguous() for k, v in full_sd.items()}, os.path.join(out_dir, FULL_WEIGHTS_NAME),
              metadata={"format": "pt"})
    with open(os.path.join(out_dir, CONFIG_NAME), "w") as f:
        json.dump(config.to_dict(), f, indent=2)


def load_full(path: str, config_path: Optional[str] = None) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Read a full checkpoint: a directory from ``save_full``, or a ``.safetensors``/``.pt``
    file plus ``config_path`` (default: ``config.json`` next to the file)."""
    if os.path.isdir(path):
        weights, config_path = os.path.join(path, FULL_WEIGHTS_NAME), config_path or os.path.join(path, CONFIG_NAME)
    else:
        weights, config_path = path, config_path or os.path.join(os.path.dirname(path), CONFIG_NAME)
    for p, what in ((weights, "weights"), (config_path, "config")):
        if not os.path.isfile(p):
            raise FileNotFoundError(f"{what} file {p} not found (expected a directory with {FULL_WEIGHTS_NAME} and "
                                    f"{CONFIG_NAME}, or a weights file plus a config json)")
    with open(config_path) as f:
        config = GPTConfig.from_dict(json.load(f))
    if weights.endswith(".safetensors"):
        from safetensors.torch import load_file

        sd = load_file(weights)
    else:
        sd = torch.load(weights, map_location="cpu", weights_only=True)
        sd = sd.get("model", sd) if isinstance(sd, dict) else sd
    return config, sd


# ---- streaming conversion (export/import at 13B without holding the model) ------------------------

_LAYER = re.compile(r"(?:^|\.)(?:h|layers)\.(\d+)\.")


def layer_of(name: str) -> int:
    """The transformer layer a (megazero, GPT-2 or Llama) tensor name belongs to; -1 for the rest."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else -1


class _LazyStateDict(Mapping):
    """A state dict whose values are produced on access: real tensors for one layer, meta for the rest."""

    def __init__(self, names: list[str], value: Callable[[str], torch.Tensor]) -> None:
        self._names, self._value, self._cache = list(names), value, {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            if name not in self._names:
                raise KeyError(name)
            self._cache[name] = self._value(name)
        return self._cache[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


class SafetensorsStreamWriter:
    """Writes a safetensors file tensor by tensor: the header (names, dtypes, shapes) first, then
    each tensor's bytes as it is produced, in header order. The file appears (renamed from
    ``.tmp``, fsync'd) only when complete."""

    def __init__(self, path: str, layout: list[tuple[str, tuple[int, ...], torch.dtype]],
                 metadata: Optional[dict[str, str]] = None) -> None:
        self.path, self.layout, self._next = path, layout, 0
        header: dict = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name, shape, dtype in layout:
            size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
            header[name] = {"dtype": CODE_OF_DTYPE[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors aligns the data region to 8 bytes
        self._f = open(path + ".tmp", "wb")
        self._f.write(struct.pack("<Q", len(raw)))
        self._f.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want, shape, dtype = self.layout[self._next]
        if name != want or tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
            raise ValueError(f"expected {want} {tuple(shape)} {dtype} next, got {name} {tuple(tensor.shape)} {tensor.dtype}")
        t = tensor.detach().cpu().contiguous()
        if t.numel():
            self._f.write(memoryview(t.reshape(-1).view(torch.uint8).numpy()))  # no copy
        self._next += 1

    def close(self) -> None:
        if self._next != len(self.layout):
            raise ValueError(f"{self.path}: {len(self.layout) - self._next} tensors were never written")
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        os.replace(self.path + ".tmp", self.path)


def convert_streaming(convert: Callable[[Mapping], dict[str, torch.Tensor]], names: list[str],
                      read: Callable[[str], torch.Tensor], meta: Callable[[str], torch.Tensor], out_path: str,
                      metadata: Optional[dict[str, str]] = None,
                      group_of: Optional[Callable[[str], int]] = None) -> list[str]:
    """Apply a whole-model state-dict converter (``to_hf_state_dict``, ``from_hf_state_dict``...) one
    layer at a time and stream the result into ``out_path``.

    The converter runs once on meta tensors (names, shapes, dtypes of the output; no data), then
    once per layer with that layer's inputs real (``read``) and every other input on the meta
    device (``meta``), and once for the tensors outside the layers. Each output depends on one
    layer's inputs, so peak memory is one layer's inputs and outputs, not the model's.
    ``group_of`` (default :func:`layer_of`) names the layer of an input or output name, where a family's
    names say it otherwise (DeepSeek's multi-token prediction modules). Returns the output names in file order.
    """
    layer_of_ = group_of or layer_of
    dry = convert(_LazyStateDict(names, meta))
    groups = sorted({layer_of_(k) for k in dry}, key=lambda g: (g < 0, g))
    order = [k for g in groups for k in dry if layer_of_(k) == g]
    writer = SafetensorsStreamWriter(out_path, [(k, tuple(dry[k].shape), dry[k].dtype) for k in order], metadata)
    try:
        for g in groups:
            out = convert(_LazyStateDict(names, lambda n, g=g: read(n) if layer_of_(n) == g else meta(n)))
            for k in order:
                if layer_of_(k) == g:
                    writer.write(k, out[k])
            del out
        writer.close()
    except BaseException:
        writer._f.close()
        if os.path.exists(out_path + ".tmp"):
            os.remove(out_path + ".tmp")
        raise
    return order
