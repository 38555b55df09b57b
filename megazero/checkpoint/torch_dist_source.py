"""A Megatron-LM ``torch_dist`` checkpoint seen in megazero's names: what the loaders and converters read.

:class:`MegatronDistSource` is a safetensors-like view (``keys()``, ``get_slice(name)[index]``) of the
checkpoint's global tensors through the name table :func:`~megazero.model.interop.megatron_dist.mcore_entries`,
each read touching only the chunks it needs (:class:`~megazero.checkpoint.torch_dist.TorchDistCheckpoint`).
:func:`open_torch_dist` adds the model's configuration from ``common.pt``'s ``args`` and refuses a key it cannot
map.
"""

from __future__ import annotations

import json
from typing import Optional

import torch

from megazero.model.config import GPTConfig
from megazero.model.interop.megatron_dist import TRANSFORMER_IMPLS, McoreEntry, mcore_entries
from megazero.utils.safetensors_dtypes import CODE_OF_DTYPE
from megazero.zero.shard_io import CheckpointError

__all__ = ["MegatronDistSource", "entries_for_checkpoint", "optimizer_state_kind", "megazero_entry", "open_torch_dist"]

_MODEL_ROOTS = ("embedding.", "decoder.", "output_layer.", "mtp.")


class _Slice:
    """One megazero tensor inside a global megatron-core tensor: ``get_shape()``, ``get_dtype()`` and
    ``[index]`` over the megazero tensor, reading only the chunks the index touches."""

    def __init__(self, ckpt, entry: McoreEntry, key: str) -> None:
        self.ckpt, self.entry, self.key = ckpt, entry, key

    def get_shape(self) -> list[int]:
        return list(self.entry.shape[len(self.entry.index):])

    def get_dtype(self) -> str:
        return CODE_OF_DTYPE[self.ckpt.dtype(self.key)]

    def __getitem__(self, index) -> torch.Tensor:
        return self.ckpt.read(self.key, self.entry.index + (index if isinstance(index, tuple) else (index,)))


class MegatronDistSource:
    """A safetensors-like view of a torch_dist checkpoint in megazero's full names: ``keys()``,
    ``get_slice(name)`` (``get_shape()``, ``get_dtype()``, ``[index]`` reading only what it touches) and
    ``get_tensor(name)``. ``prefix`` reads another copy of the model's tensors, e.g.
    ``"optimizer.state.exp_avg."`` for Adam's first moments. Every entry's key (or an alias) must be in the
    checkpoint with the global shape the config gives, else CheckpointError naming key and shapes."""

    def __init__(self, ckpt, config: GPTConfig, prefix: str = "",
                 entries: Optional[list[McoreEntry]] = None) -> None:
        self.ckpt, self.config, self.prefix = ckpt, config, prefix
        entries = entries if entries is not None else entries_for_checkpoint(ckpt, config)
        present = set(ckpt.keys())
        self._entries: dict[str, tuple[McoreEntry, str]] = {}
        for e in entries:
            key = next((prefix + k for k in (e.key,) + e.aliases if prefix + k in present), None)
            if key is None:
                raise CheckpointError(f"{ckpt.directory}: no {prefix + e.key} (megazero's {prefix}{e.name}) in the "
                                      f"checkpoint: it was saved from another model shape or without that state")
            got = tuple(ckpt.global_shape(key))
            if got != e.shape:
                raise CheckpointError(f"{ckpt.directory}: {key} has global shape {got} but the model's config gives "
                                      f"{e.shape} (megazero's {e.name} {e.shape[len(e.index):]}); check --vocab-size "
                                      f"and the run's arguments")
            self._entries[e.name] = (e, key)

    def keys(self) -> list[str]:
        return list(self._entries)

    def mapped_keys(self) -> set[str]:
        """The checkpoint keys this view reads."""
        return {key for _, key in self._entries.values()}

    def get_slice(self, name: str) -> _Slice:
        if name not in self._entries:
            raise KeyError(f"{name!r} is not a tensor of this model (keys(): {len(self._entries)} names)")
        e, key = self._entries[name]
        return _Slice(self.ckpt, e, key)

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[...]


def entries_for_checkpoint(ckpt, config: GPTConfig) -> list[McoreEntry]:
    """The table in the layout ``ckpt`` was written in: per-layer or stacked keys as its keys show, the layer
    spec of its ``args.transformer_impl`` (aliases cover the other)."""
    per_layer = any(k.startswith("decoder.layers.0.") for k in ckpt.keys())
    impl = getattr(getattr(ckpt, "args", None), "transformer_impl", None)
    return mcore_entries(config, transformer_impl=impl if impl in TRANSFORMER_IMPLS else "transformer_engine",
                         per_layer=per_layer)


def optimizer_state_kind(ckpt) -> str:
    """'fully_reshardable' (model-space Adam state per key), 'dp_reshardable' (flat per-bucket buffers, not
    reshardable across TP/PP), another megatron-core sharding type named in ``common.pt``, or 'none'."""
    opt = ckpt.common.get("optimizer")
    opts = opt if isinstance(opt, list) else [opt]
    for o in opts:
        if isinstance(o, dict) and isinstance(o.get("param_state_sharding_type"), str):
            kind = o["param_state_sharding_type"]
            return "fully_reshardable" if kind == "fully_sharded_model_space" else kind
    keys = ckpt.keys()
    if any(k.startswith("optimizer.state.") for k in keys):
        return "fully_reshardable"
    if any(k.startswith("optimizer.distributed.") for k in keys) or any(
            "optimizer.distributed." in k for k in getattr(ckpt.metadata, "state_dict_metadata", {})):
        return "dp_reshardable"
    return "none"


def megazero_entry(common: dict) -> Optional[dict]:
    """``common.pt``'s ``megazero`` entry (train state, config, engine: dicts or JSON text), None when absent."""
    entry = common.get("megazero")
    if entry is None:
        return None
    entry = json.loads(entry) if isinstance(entry, (str, bytes)) else dict(entry)
    return {k: json.loads(v) if isinstance(v, (str, bytes)) else v for k, v in entry.items()}


def open_torch_dist(path: str, vocab_size: Optional[int] = None) -> tuple[GPTConfig, MegatronDistSource, dict]:
    """``(GPTConfig, MegatronDistSource, info)`` of a Megatron-LM torch_dist checkpoint (``--save`` dir or one
    iteration dir). The config comes from ``common.pt``'s args (megazero's own config where megazero saved it);
    ``info``: format, iteration, the run's tp/pp/ep,
    ``optimizer`` (``optimizer_state_kind``), ``bytes_read``. A model key megazero cannot map is refused."""
    from megazero.checkpoint.torch_dist import TorchDistCheckpoint
    from megazero.model.interop.megatron_import import config_from_megatron_args

    ckpt = TorchDistCheckpoint(path)
    own = megazero_entry(ckpt.common)
    if ckpt.args is None:
        raise CheckpointError(f"{ckpt.directory}/common.pt has no 'args' (the run's arguments): megazero cannot "
                              f"tell the model's shape; is this a Megatron-LM checkpoint?")
    try:
        if own is not None and isinstance(own.get("config"), dict) and isinstance(own["config"].get("model"), dict):
            config = GPTConfig.from_dict(own["config"]["model"]).validate()  # megazero's save: its exact config
        else:
            config = config_from_megatron_args(ckpt.args, vocab_size).validate()
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{ckpt.directory}: the run's arguments do not give a megazero model: {e}") from None
    source = MegatronDistSource(ckpt, config)
    mapped = source.mapped_keys()
    foreign = [k for k in ckpt.keys() if k not in mapped and not k.startswith("optimizer.")]
    if foreign:
        hint = (" (saved with singleton local shards, which megazero does not read)"
                if any(k.endswith(("_w", "_v")) for k in foreign) else "")
        raise CheckpointError(f"{ckpt.directory}: megazero cannot map {foreign[0]!r} (global shape "
                              f"{ckpt.global_shape(foreign[0])}){hint} and {len(foreign) - 1} more such keys: the model "
                              f"uses a feature megazero does not have, or the args do not describe it")
    args = ckpt.args
    info = {"format": "megatron-lm torch_dist", "iteration": ckpt.iteration,
            "tp": int(getattr(args, "tensor_model_parallel_size", 1) or 1),
            "pp": int(getattr(args, "pipeline_model_parallel_size", 1) or 1),
            "ep": int(getattr(args, "expert_model_parallel_size", 1) or 1),
            "optimizer": optimizer_state_kind(ckpt), "directory": ckpt.directory}
    return config, source, info
