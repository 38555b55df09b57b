"""The checkpoint formats a run saves and resumes, behind one protocol.

A format says whether a ``--load`` directory holds it (``holds``), stages a save of the engine's state
(``stage``: written then by :mod:`~megazero.checkpoint.async_save`, in the foreground or the background),
and loads one into the engine (``load``: the train state, or None when the directory holds no checkpoint
yet). The loop's checkpointer asks :func:`format_to_save` for ``--ckpt-format`` and :func:`format_to_load`
for ``--load``; a new format is one module and one entry of :data:`FORMATS`.

* ``megazero``: megazero's own (:mod:`~megazero.checkpoint.native`): reloads at any layout, verified by
  checksum, every rank's RNG;
* ``torch_dist``: Megatron-LM's (:mod:`~megazero.checkpoint.torch_dist_save` writes it,
  :mod:`~megazero.checkpoint.megatron_resume` reads megazero's and Megatron-LM's).
"""

from __future__ import annotations

from typing import Any, Callable, ClassVar, Optional, Protocol

from megazero.checkpoint.async_save import PendingSave
from megazero.checkpoint.megatron_resume import is_torch_dist_load, read_torch_dist
from megazero.checkpoint.native import load_checkpoint, stage_checkpoint
from megazero.checkpoint.torch_dist_save import stage_torch_dist
from megazero.model.config import GPTConfig
from megazero.model.interop.megatron_dist import mcore_entries
from megazero.utils.output import rank_zero_logger
from megazero.utils.phase_agreement import agree

__all__ = ["CheckpointFormat", "FORMATS", "format_to_load", "format_to_save"]

log = rank_zero_logger(__name__)


class CheckpointFormat(Protocol):
    """One checkpoint format, built once per run for its model."""

    name: ClassVar[str]

    @staticmethod
    def holds(directory: str) -> bool:
        """Whether ``directory`` (a ``--load``) is a checkpoint of this format."""

    def stage(self, save: str, iteration: int, engine, *, train_state: dict[str, Any], config: dict[str, Any],
              tokenizer=None, pipeline=None, group=None, copy: bool = False,
              on_written: Optional[Callable[[str], None]] = None) -> PendingSave:
        """Collective over ``group``: the save of ``iteration`` into ``save``, staged (not written yet)."""

    def load(self, directory: str, engine, *, iteration: Optional[int], pipeline, load_optimizer: bool,
             finetune: bool) -> Optional[dict[str, Any]]:
        """Collective: fill ``engine`` from ``directory``; the train state (``iteration``, ``consumed_samples``,
        ``lr_scheduler``, ``resharded``), or None when there is no checkpoint there yet."""


class NativeFormat:
    """megazero's own format: everything to continue exactly, at any layout."""

    name: ClassVar[str] = "megazero"

    def __init__(self, model: GPTConfig, transformer_impl: str) -> None:
        pass  # the format depends on the engine's state only

    @staticmethod
    def holds(directory: str) -> bool:
        return True  # the default: a directory without a checkpoint is a fresh start

    def stage(self, save: str, iteration: int, engine, **kw) -> PendingSave:
        return stage_checkpoint(save, iteration, engine, **kw)

    def load(self, directory: str, engine, *, iteration: Optional[int], pipeline, load_optimizer: bool,
             finetune: bool) -> Optional[dict[str, Any]]:
        return load_checkpoint(directory, engine, iteration, pipeline=pipeline, load_optimizer=load_optimizer)


class TorchDistFormat:
    """Megatron-LM's ``torch_dist``, each rank writing and reading its share; read by megatron-core."""

    name: ClassVar[str] = "torch_dist"

    def __init__(self, model: GPTConfig, transformer_impl: str) -> None:
        self.model, self.transformer_impl = model, transformer_impl
        self._entries: Optional[list] = None  # megatron-core's name table, built at the first save

    holds = staticmethod(is_torch_dist_load)

    def stage(self, save: str, iteration: int, engine, **kw) -> PendingSave:
        if self._entries is None:
            self._entries = mcore_entries(self.model, transformer_impl=self.transformer_impl)
        return stage_torch_dist(save, iteration, engine, **kw, transformer_impl=self.transformer_impl,
                                entries=self._entries)

    def load(self, directory: str, engine, *, iteration: Optional[int], pipeline, load_optimizer: bool,
             finetune: bool) -> dict[str, Any]:
        state = agree("checkpoint load", lambda: read_torch_dist(
            directory, engine, self.model, iteration=iteration, load_optimizer=load_optimizer, finetune=finetune))
        engine.global_steps, engine.skipped_steps, engine.micro_steps = state["iteration"], 0, 0
        own = state.get("engine")  # megazero's own torch_dist save: its loss scaler and counters
        if own is not None and own.get("precision") == str(engine.compute_dtype).replace("torch.", ""):
            engine.loss_scaler.load_state_dict(own["loss_scaler"])
            engine.global_steps, engine.skipped_steps = own["global_steps"], own["skipped_steps"]
        for note in state["notes"]:
            log.info(f"> {note}")
        log.info(f"> loaded {state['directory']} (torch_dist: "
                 + ("weights and optimizer" if state["optimizer_loaded"] else "weights only")
                 + f", {state['bytes_read'] / 2 ** 20:.2f} MiB read by this rank"
                 + "); the RNG is freshly seeded (the saved states belong to "
                 + ("another layout" if state["source"] == "megazero" else "Megatron-LM's generators") + ")")
        state["resharded"] = True
        return state


# --ckpt-format's values; a --load is read by the first format that holds it (the default, last, holds any).
FORMATS: dict[str, type] = {f.name: f for f in (TorchDistFormat, NativeFormat)}


def format_to_save(name: str, model: GPTConfig, transformer_impl: str) -> CheckpointFormat:
    """The format ``--ckpt-format name`` writes."""
    if name not in FORMATS:
        raise ValueError(f"unknown checkpoint format {name!r}: one of {', '.join(FORMATS)}")
    return FORMATS[name](model, transformer_impl)


def format_to_load(directory: str, model: GPTConfig, transformer_impl: str) -> CheckpointFormat:
    """The format ``directory`` (a ``--load``) holds."""
    kind = next(f for f in FORMATS.values() if f.holds(directory))
    return kind(model, transformer_impl)
