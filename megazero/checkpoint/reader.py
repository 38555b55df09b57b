"""Open any checkpoint to read its model: the one loader of every program that reads a checkpoint
(tools/generate.py, tools/convert_to_hf.py, tools/convert_from_megatron.py and pretrain_gpt.py's model and
tokenizer resolution).

Formats, told apart by :func:`checkpoint_format`:

* ``torch_dist``: Megatron-LM's distributed format, as Megatron-LM or ``pretrain_gpt.py --ckpt-format
  torch_dist`` writes it (its ``--save`` directory or one ``iter_*`` directory). The model is megazero's saved
  config where megazero wrote it, else the one Megatron's ``args`` in ``common.pt`` describe (its vocabulary the
  padded one, as pretrain_gpt.py --load reads it). Tensors are read chunk by chunk
  (``megazero.checkpoint.torch_dist_source``).
* ``megazero``: a ``--save`` directory of pretrain_gpt.py (its latest iteration, or ``iteration``) or one of
  its ``iter_*`` directories; every byte read is verified against the manifest.
* ``full``: ``model_full.safetensors`` + ``config.json`` (+ ``tokenizer/``), as the converters write.

Megatron-LM's legacy ``mp_rank_XX`` and Megatron-DeepSpeed checkpoints are refused with the converter that
reads them (tools/convert_from_megatron.py).
"""

from __future__ import annotations

import json
import os
from typing import Any, Optional

import torch

from megazero.checkpoint.native import (
    FULL_WEIGHTS,
    TOKENIZER_DIR,
    _saved_buffers,
    _verified,
    is_full_checkpoint,
    read_manifest,
    resolve_checkpoint_dir,
)
from megazero.mpu.sharding import shard_ranges
from megazero.utils.safetensors_dtypes import DTYPE_OF_CODE
from megazero.zero.shard_io import CheckpointError

__all__ = ["CHECKPOINT_FORMATS", "checkpoint_format", "open_checkpoint", "saved_model_config",
           "checkpoint_tokenizer_dir", "SliceReader", "FullWeightsReader", "WithBuffers"]

CHECKPOINT_FORMATS = ("torch_dist", "megazero", "full")


def checkpoint_format(load: str, iteration: Optional[int] = None) -> str:
    """Which of ``CHECKPOINT_FORMATS`` the checkpoint ``load`` (with ``iteration``, the one to read) is; a
    directory that holds none of them raises CheckpointError saying what it holds and what to pass."""
    from megazero.checkpoint.megatron_legacy import detect_foreign_checkpoint
    from megazero.checkpoint.megatron_resume import is_torch_dist_load

    if not os.path.isdir(load):
        raise CheckpointError(f"{load} is not a directory: pass a checkpoint directory")
    if is_torch_dist_load(load):
        return "torch_dist"
    if is_full_checkpoint(load, iteration):
        return "full"
    foreign = detect_foreign_checkpoint(load)
    if foreign:
        raise CheckpointError(foreign)
    resolve_checkpoint_dir(load, iteration)  # raises, naming every form it looked for, when there is none
    return "megazero"


def saved_model_config(load: str, iteration: Optional[int] = None) -> tuple[str, dict[str, Any]]:
    """``(the file it was read from, GPTConfig dict)`` of a checkpoint of any format, read before any process
    starts (the load verifies every file later). Raises CheckpointError naming the file."""
    kind = checkpoint_format(load, iteration)
    if kind == "torch_dist":
        from megazero.checkpoint.megatron_resume import torch_dist_model_config

        return torch_dist_model_config(load, iteration)
    if kind == "full":
        path = os.path.join(load, "config.json")
        model = _read_json(path)
    else:
        path = os.path.join(resolve_checkpoint_dir(load, iteration), "config.json")
        saved = _read_json(path)
        model = saved.get("model") if isinstance(saved, dict) else None
    if not isinstance(model, dict):
        raise CheckpointError(f"{path} holds no model configuration")
    return path, model


def _read_json(path: str) -> Any:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


def checkpoint_tokenizer_dir(load: str, iteration: Optional[int] = None) -> Optional[str]:
    """The ``tokenizer/`` directory recorded in a checkpoint of any format, None when it recorded none
    (Megatron-LM records none: its args name a tokenizer by type and the paths of the machine that saved it)."""
    kind = checkpoint_format(load, iteration)
    if kind == "torch_dist":
        from megazero.checkpoint.megatron_resume import torch_dist_tokenizer_dir

        return torch_dist_tokenizer_dir(load, iteration)
    base = load if kind == "full" else resolve_checkpoint_dir(load, iteration)
    found = os.path.join(base, TOKENIZER_DIR)
    return found if os.path.isfile(os.path.join(found, "megazero_tokenizer.json")) else None


def open_checkpoint(load: str, iteration: Optional[int] = None, *, vocab_size: Optional[int] = None):
    """``(GPTConfig, reader, saved TrainConfig dict)`` of a checkpoint of any format. The reader gives any
    tensor's full value or TP shard under megazero's tp = 1 names (``names``, ``full_shape``, ``full``,
    ``tp_shard``; ``full_dtype`` where the stored dtype is not fp32), reading only its bytes; the model's
    persistent buffers (the routers' expert biases) are among ``names``. The saved dict holds at least
    ``model`` (and, for torch_dist, ``torch_dist``: the format, iteration, the run's tp/pp/ep, its optimizer
    state's kind). ``vocab_size``: a Megatron-LM torch_dist checkpoint's tokenizer vocabulary, its padding rows
    dropped (tools/convert_from_megatron.py --vocab-size); default: the padded vocabulary."""
    from megazero.model import GPTConfig
    from megazero.zero.checkpoint import CheckpointReader

    kind = checkpoint_format(load, iteration)
    if kind == "torch_dist":
        return _open_torch_dist(load, iteration, vocab_size)
    if kind == "full":
        _, model = saved_model_config(load)
        config = GPTConfig.from_dict(model)
        return config, FullWeightsReader(os.path.join(load, FULL_WEIGHTS), config), {"model": model}
    directory = resolve_checkpoint_dir(load, iteration)
    manifest = read_manifest(directory)
    saved = json.load(open(_verified(directory, manifest, "config.json")))
    reader = CheckpointReader(directory, manifest)
    buffers = _saved_buffers(directory, manifest)
    return GPTConfig.from_dict(saved["model"]), (WithBuffers(reader, buffers) if buffers else reader), saved


def _open_torch_dist(load: str, iteration: Optional[int], vocab_size: Optional[int]):
    from megazero.checkpoint.megatron_resume import torch_dist_path
    from megazero.checkpoint.torch_dist_source import megazero_entry, open_torch_dist

    config, source, info = open_torch_dist(torch_dist_path(load, iteration), vocab_size=vocab_size)
    own = megazero_entry(source.ckpt.common)
    saved = own["config"] if own is not None and isinstance(own.get("config"), dict) else {"model": config.to_dict()}
    return config, SliceReader(source, config, info["directory"]), {**saved, "torch_dist": info}


class WithBuffers:
    """A training checkpoint's reader that also gives the model's saved persistent buffers (the routers'
    expert biases): whole tensors on every TP rank, by their global names."""

    def __init__(self, reader, buffers: dict[str, torch.Tensor]) -> None:
        self.reader, self.buffers = reader, buffers
        self.names = list(reader.names) + [n for n in buffers if n not in set(reader.names)]

    def full_shape(self, name: str) -> list[int]:
        return list(self.buffers[name].shape) if name in self.buffers else self.reader.full_shape(name)

    def full(self, name: str, **kw) -> torch.Tensor:
        return self.buffers[name].clone() if name in self.buffers else self.reader.full(name, **kw)

    def tp_shard(self, name: str, rank: int, world: int, **kw) -> torch.Tensor:
        return self.buffers[name].clone() if name in self.buffers else self.reader.tp_shard(name, rank, world, **kw)

    def __getattr__(self, attr: str):  # the rest of CheckpointReader's interface
        return getattr(self.reader, attr)


class SliceReader:
    """Full (tp = 1 names and shapes) tensors of a safetensors-like ``handle`` (``keys()``, ``get_tensor(name)``,
    ``get_slice(name)`` with ``get_shape()``, ``get_dtype()`` and ``[index]``: a safetensors file, a torch_dist
    checkpoint's ``MegatronDistSource``) with the reading interface of ``zero.checkpoint.CheckpointReader``:
    ``names``, ``full_shape``, ``full`` (in the stored dtype, ``full_dtype``) and ``tp_shard``, which reads only
    the rows (or columns) of its shard. ``where`` names the checkpoint in errors; ``source`` is ``handle``."""

    def __init__(self, handle, config, where: str) -> None:
        self.source, self.config, self.path = handle, config, where
        self.names = list(handle.keys())
        self._layout: Optional[dict[str, tuple[bool, int, int]]] = None

    def full_shape(self, name: str) -> list[int]:
        return list(self.source.get_slice(name).get_shape())

    def full_dtype(self, name: str) -> torch.dtype:
        return DTYPE_OF_CODE[self.source.get_slice(name).get_dtype()]

    def full(self, name: str) -> torch.Tensor:
        return self.source.get_tensor(name)

    def tp_shard(self, name: str, rank: int, world: int) -> torch.Tensor:
        """TP rank ``rank`` of ``world``'s shard of ``name``, split as the model's parameter is."""
        if self._layout is None:  # how each parameter is split: a meta model's attributes
            from megazero.model import GPTModel

            model = GPTModel(self.config, device="meta")
            self._layout = {n: (bool(getattr(p, "tensor_model_parallel", False)), int(getattr(p, "partition_dim", 0)),
                                int(getattr(p, "partition_stride", 1))) for n, p in model.named_parameters()}
        sharded, dim, stride = self._layout.get(name, (False, 0, 1))
        handle = self.source.get_slice(name)
        if not sharded or world == 1:
            return handle[:]
        shape = handle.get_shape()
        try:
            ranges = shard_ranges(shape[dim], stride, rank, world)
        except ValueError:
            raise CheckpointError(f"{self.path}: {name} has {shape[dim]} entries along dim {dim}, which do not split "
                                  f"over tp {world}; use a --tp that divides it") from None
        index, parts = [slice(None)] * len(shape), []
        for lo, hi in ranges:  # only the shard's bytes are read
            index[dim] = slice(lo, hi)
            parts.append(handle[tuple(index)])
        return torch.cat(parts, dim=dim)


class FullWeightsReader(SliceReader):
    """A full checkpoint's ``model_full.safetensors`` (or any full safetensors state dict) at ``path``."""

    def __init__(self, path: str, config) -> None:
        from safetensors import safe_open

        try:
            handle = safe_open(path, framework="pt")
        except Exception as e:  # safetensors raises several types for bad headers/sizes
            raise CheckpointError(f"cannot read {path}: {e} (truncated or not a safetensors file?)") from None
        super().__init__(handle, config, path)


