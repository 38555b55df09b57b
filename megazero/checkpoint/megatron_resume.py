"""Resuming (or fine-tuning) from a Megatron-LM ``torch_dist`` checkpoint at any megazero layout.

As Megatron-LM's ``load_checkpoint``: the run continues after ``common.pt``'s ``iteration`` with
``args.consumed_train_samples`` samples consumed (0 where the args hold none; the sampler continues from
there). The weights are always read; the optimizer state unless weights only are asked for
(``--no-load-optim``, ``--finetune``) or the checkpoint has none (``--no-save-optim``). The LR schedule is read
with the optimizer state only, as Megatron-LM reads it: then at ``opt_param_scheduler``'s position (its keys
mapped onto :class:`~megazero.training.lr_schedule.LRScheduler`'s); without it the run's own schedule starts
at its step 0, and the log says so. megatron-core's distributed optimizer state is read in both its sharding
types: ``fully_reshardable`` (the fp32 master and Adam's moments as ``optimizer.state.{param,exp_avg,
exp_avg_sq}.<model key>`` of the model key's global shape, at any layout; the step in ``common.pt``'s param
groups) and ``dp_reshardable`` (flat per-bucket buffers, :mod:`~megazero.checkpoint.torch_dist_buckets`, at the
layout that saved it; the step in the param groups saved beside them), also under a chained optimizer.
Another layout is refused, naming the way out. Megatron's saved RNG belongs to Megatron's generators: the
run's fresh seeding stands.

A torch_dist checkpoint megazero wrote has a ``megazero`` entry in ``common.pt`` (its train state and config):
the iteration, samples and LR schedule come from there, exactly.

Each rank reads only the chunks holding its share (``megazero.zero.source_load``).
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional

import torch

from megazero.checkpoint.torch_dist_source import megazero_entry
from megazero.zero.shard_io import CheckpointError

__all__ = ["is_torch_dist_load", "torch_dist_path", "torch_dist_model_config", "torch_dist_tokenizer_dir",
           "megatron_scheduler_state", "read_torch_dist"]


def is_torch_dist_load(load: Optional[str]) -> bool:
    """Whether ``load`` is a torch_dist checkpoint (a ``--save`` directory or one iteration directory)."""
    if not load:
        return False
    try:
        from megazero.checkpoint.torch_dist import is_torch_dist
    except ModuleNotFoundError:  # a build without the torch_dist reader
        return False
    return is_torch_dist(load)


def torch_dist_path(load: str, iteration: Optional[int] = None) -> str:
    """The directory to open: ``load`` itself, or its ``iter_XXXXXXX`` for ``--ckpt-step``."""
    if iteration is None:
        return load
    directory = os.path.join(load, f"iter_{iteration:07d}")
    if not os.path.isdir(directory):
        raise CheckpointError(f"--ckpt-step {iteration}: {directory} does not exist")
    return directory


def torch_dist_model_config(load: str, iteration: Optional[int] = None) -> tuple[str, dict[str, Any]]:
    """``(where, GPTConfig dict)`` of a torch_dist checkpoint: megazero's saved config, or the model
    Megatron-LM's ``args`` describe, its vocabulary the padded one (Megatron-LM's softmax covers the padding
    rows; ``args.vocab_size`` is only a NullTokenizer's argument, one less than its vocabulary). Raises
    CheckpointError naming the file."""
    from megazero.checkpoint.torch_dist import TorchDistCheckpoint
    from megazero.model.interop.megatron_import import config_from_megatron_args

    ckpt = TorchDistCheckpoint(torch_dist_path(load, iteration))
    where = os.path.join(ckpt.directory, "common.pt")
    own = megazero_entry(ckpt.common)
    if own is not None and isinstance(own.get("config"), dict) and isinstance(own["config"].get("model"), dict):
        return where, own["config"]["model"]
    if ckpt.args is None:
        raise CheckpointError(f"{where} has no 'args' (the run's arguments): megazero cannot tell the model's shape")
    try:
        config = config_from_megatron_args(ckpt.args)
    except (ValueError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{where}: the run's arguments do not give a megazero model: {e}") from None
    return where, config.to_dict()


def torch_dist_tokenizer_dir(load: str, iteration: Optional[int] = None) -> Optional[str]:
    """The ``tokenizer/`` directory megazero recorded beside a torch_dist iteration, None when there is none
    (Megatron-LM records none: its args name a tokenizer by type and paths of the machine that saved it)."""
    from megazero.checkpoint.torch_dist import resolve_iteration_dir

    directory, _ = resolve_iteration_dir(torch_dist_path(load, iteration))
    found = os.path.join(directory, "tokenizer")
    return found if os.path.isfile(os.path.join(found, "megazero_tokenizer.json")) else None


# Megatron's OptimizerParamScheduler.state_dict() keys (and older names) -> megazero's LRScheduler's.
_SCHEDULER_KEYS = (("max_lr", ("max_lr", "start_lr")), ("min_lr", ("min_lr",)),
                   ("warmup_steps", ("lr_warmup_steps", "warmup_steps", "warmup_iter")),
                   ("decay_steps", ("lr_decay_steps", "decay_steps", "end_iter")),
                   ("decay_style", ("lr_decay_style", "decay_style")),
                   ("num_steps", ("num_steps", "num_iters")))
_WD_KEYS = ("start_wd", "end_wd", "wd_incr_steps", "wd_incr_style")


def megatron_scheduler_state(sd: dict) -> dict[str, Any]:
    """megazero's LRScheduler state for Megatron's ``opt_param_scheduler`` dict. A constant weight decay is
    the optimizer's, not a schedule (megazero schedules none then): its keys are left out."""
    out: dict[str, Any] = {}
    for ours, theirs in _SCHEDULER_KEYS:
        found = next((sd[k] for k in theirs if k in sd), None)
        if found is not None:
            out[ours] = found
    if "num_steps" not in out:
        raise CheckpointError(f"opt_param_scheduler {sorted(sd)} has no num_steps: not Megatron's scheduler state")
    if sd.get("wd_incr_style", "constant") != "constant":
        out.update({k: sd[k] for k in _WD_KEYS if k in sd})
    return out


def _optimizers(common: dict) -> list[dict]:
    """``common.pt``'s optimizer state dicts: one, or a chained optimizer's (a list, or a dict by index)."""
    opt = common.get("optimizer")
    if isinstance(opt, dict) and opt and all(isinstance(k, int) for k in opt):
        opt = [opt[k] for k in sorted(opt)]
    return [o for o in (opt if isinstance(opt, list) else [opt]) if isinstance(o, dict)]


def _optimizer_step(common: dict, fallback: int) -> tuple[int, bool]:
    """Adam's step count from ``common.pt``'s optimizer param groups (the distributed optimizer), or the plain
    optimizer's state (megatron-core's ``common_step``, or a step per parameter); ``fallback`` when none holds
    one. Whether it was found."""
    steps = set()
    for o in _optimizers(common):
        inner = o.get("optimizer", o)
        groups = inner.get("param_groups", []) if isinstance(inner, dict) else []
        state = inner.get("state", {}) if isinstance(inner, dict) else {}
        state = state if isinstance(state, dict) else {}
        found = [g.get("step") for g in groups if isinstance(g, dict)] + [state.get("common_step")]
        found += [v.get("step") for v in state.values() if isinstance(v, dict)]
        steps |= {int(x.item() if isinstance(x, torch.Tensor) else x) for x in found if x is not None}
    if len(steps) > 1:
        raise CheckpointError(f"the optimizer's param groups hold different steps {sorted(steps)}")
    return (steps.pop(), True) if steps else (fallback, False)


def _refuse_layout(ckpt, kind: str) -> None:
    raise CheckpointError(f"{ckpt.directory}: its optimizer state is megatron-core's {kind} layout, which megazero "
                          "does not read; load the weights only with --no-load-optim, or re-save it in Megatron-LM "
                          "with --dist-ckpt-optim-fully-reshardable")


def _optimizer_kind(ckpt) -> str:
    """The optimizer state's layout: ``common.pt``'s ``param_state_sharding_type`` (of any chained part), else
    what the keys show ('fully_reshardable', 'dp_reshardable' or 'none')."""
    import re

    from megazero.checkpoint.torch_dist_source import optimizer_state_kind

    for o in _optimizers(ckpt.common):
        kind = o.get("param_state_sharding_type")
        if isinstance(kind, str):
            return "fully_reshardable" if kind == "fully_sharded_model_space" else kind
    if any(re.match(r"chained_\d+\.optimizer\.state\.", k) for k in ckpt.keys()):
        return "fully_reshardable"
    return optimizer_state_kind(ckpt)


class _Union:
    """Several sources as one: each name from the first that has it (a chained optimizer's parts)."""

    def __init__(self, sources: list) -> None:
        self._of = {n: s for s in reversed(sources) for n in s.keys()}

    def keys(self) -> list[str]:
        return list(self._of)

    def get_slice(self, name: str) -> Any:
        return self._of[name].get_slice(name)


def _optimizer_sources(ckpt, config, table: list, names: set[str], wanted: tuple[str, ...], optimizer: str
                       ) -> tuple[Optional[Any], dict[str, Any]]:
    """(master source or None, state key -> source) of a fully_reshardable optimizer state, for ``names`` of the
    checkpoint's name ``table`` (``entries_for_checkpoint``) and the run's optimizer state keys ``wanted``
    (Adam's moments, SGD's ``momentum_buffer``). The state keys are
    ``optimizer.state.<what>.<model key>``, under a chained optimizer saved with prefixes
    ``chained_<i>.optimizer.state...`` (each model key in one part)."""
    import re

    from megazero.checkpoint.torch_dist_source import MegatronDistSource

    entries = [e for e in table if e.name in names]
    keys = set(ckpt.keys())
    chains = sorted({m.group(1) for k in keys if (m := re.match(r"(chained_\d+\.)optimizer\.state\.", k))})
    chains = ([""] if any(k.startswith("optimizer.state.") for k in keys) else []) + chains

    def source(what: str) -> Optional[Any]:
        parts = []
        for chain in chains:
            prefix = f"{chain}optimizer.state.{what}."
            present = [e for e in entries if any(prefix + k in keys for k in (e.key,) + e.aliases)]
            if not present:
                continue
            try:
                parts.append(MegatronDistSource(ckpt, config, prefix=prefix, entries=present))
            except CheckpointError as e:
                if "global shape" in str(e):  # flat tensors where the model's shapes belong: not reshardable
                    _refuse_layout(ckpt, f"flat ({_optimizer_kind(ckpt)}, not model-shaped)")
                raise
        return _Union(parts) if parts else None

    moments = {}
    for m in wanted:
        moments[m] = source(m)
        if moments[m] is None:
            raise CheckpointError(f"{ckpt.directory} holds optimizer state but no {m} (optimizer.state.{m}.*), "
                                  f"which this run's {optimizer} keeps: it was saved by another optimizer; resume "
                                  "with that one, or load the weights only with --no-load-optim")
    master = next((found for what in ("param", "fp32_param") if (found := source(what)) is not None), None)
    return master, moments


def _restore_buffers(engine, source) -> None:
    """The model's persistent buffers (the routers' expert biases) by global name from the weights' source."""
    from megazero.checkpoint.native import _named_persistent_buffers

    have = set(source.keys())
    with torch.no_grad():
        for name, b in _named_persistent_buffers(engine):
            full = engine.param_name(name)
            if full not in have:
                raise CheckpointError(f"{source.ckpt.directory} lacks the model buffer {full}: it was saved by a "
                                      "model without it; resume with the same model")
            b.copy_(source.get_slice(full)[...].to(b.device, b.dtype))


def _train_state(ckpt, own: Optional[dict], finetune: bool, with_optimizer: bool) -> dict[str, Any]:
    """iteration, consumed samples, LR schedule (megazero's format, None: the command line's) and where they came
    from (``own``: the ``megazero`` entry of a megazero save). As Megatron-LM's load_checkpoint: the samples
    from ``args.consumed_train_samples`` (0 where absent), the schedule only with the optimizer state."""
    if own is not None and isinstance(own.get("train_state"), dict):
        state = dict(own["train_state"])
        state["source"] = "megazero"
        return state
    iteration = ckpt.common.get("iteration", ckpt.iteration)
    if iteration is None and not finetune:
        raise CheckpointError(f"{ckpt.directory}/common.pt has no iteration (a 'release' checkpoint?): start from its "
                              "weights with --finetune")
    consumed = getattr(ckpt.args, "consumed_train_samples", None) if ckpt.args is not None else None
    sched = ckpt.common.get("opt_param_scheduler", ckpt.common.get("lr_scheduler"))
    if with_optimizer and not isinstance(sched, dict):
        raise CheckpointError(f"{ckpt.directory}/common.pt holds optimizer state but no opt_param_scheduler: load "
                              "the weights only with --no-load-optim (the LR schedule then is the command line's)")
    return {"iteration": int(iteration or 0), "consumed_samples": int(consumed or 0),
            "lr_scheduler": megatron_scheduler_state(sched) if with_optimizer else None, "source": "megatron",
            "samples_note": None if consumed is not None or finetune else
            f"{ckpt.directory}/common.pt's args hold no consumed_train_samples: the data starts at sample 0"}


def _read_steps(ckpt, kind: str, iteration: int) -> tuple[int, bool]:
    """Adam's step count: from common.pt's param groups, or (dp_reshardable) from the optimizers' param groups
    saved beside the buckets; ``iteration`` (and False) when neither holds one."""
    if kind != "dp_reshardable":
        return _optimizer_step(ckpt.common, iteration)
    objects = [k for k in ckpt.objects() if re.fullmatch(r"(chained_\d+\.)?optimizer\.distributed\.dp_group_idx_\d+"
                                                           r"\.optimizer/shard_.*", k)]
    parts = []
    for key in objects:
        state = ckpt.read_object(key)
        parts += state if isinstance(state, list) else [state]
    return _optimizer_step({"optimizer": [{"optimizer": p} for p in parts if isinstance(p, dict)]}, iteration)


def _dp_reshardable_sources(ckpt, engine, table: list, weights, wanted: tuple[str, ...]) -> tuple[Any, dict]:
    """(master source, moment sources) of this rank's parameters from megatron-core's dp_reshardable buckets."""
    from megazero import mpu
    from megazero.checkpoint.torch_dist_buckets import BucketLayout, BucketSource

    coords = dict(tp=mpu.get_tensor_model_parallel_world_size(), tp_rank=mpu.get_tensor_model_parallel_rank(),
                  pp=mpu.get_pipeline_model_parallel_world_size(), pp_rank=mpu.get_pipeline_model_parallel_rank(),
                  ep=mpu.get_expert_model_parallel_world_size(), ep_rank=mpu.get_expert_model_parallel_rank(),
                  etp=mpu.get_expert_tensor_parallel_world_size(), etp_rank=mpu.get_expert_tensor_parallel_rank())
    layout = BucketLayout(ckpt, engine, table, ckpt.args, coords)
    return (BucketSource(ckpt, layout, "param", weights),
            {m: BucketSource(ckpt, layout, m, weights) for m in wanted})


def read_torch_dist(load: str, engine, config, *, iteration: Optional[int] = None, load_optimizer: bool = True,
                    finetune: bool = False) -> dict[str, Any]:
    """Collective-free: fill ``engine`` (its model ``config``) from the torch_dist checkpoint ``load`` and
    return its train state: ``iteration``, ``consumed_samples``, ``lr_scheduler`` (megazero's format; None when
    the optimizer state is not read: the run's own schedule from its start, as Megatron-LM's),
    ``optimizer_loaded``, ``bytes_read`` (this rank's, of the ``.distcp`` files), ``directory``, ``notes``, and
    ``engine`` (a megazero save's loss scaler and step counters, when the optimizer was loaded; else None)."""
    from megazero.checkpoint.torch_dist import TorchDistCheckpoint
    from megazero.checkpoint.torch_dist_source import MegatronDistSource, entries_for_checkpoint
    from megazero.zero.checkpoint import load_full_weights_file

    ckpt = TorchDistCheckpoint(torch_dist_path(load, iteration))
    own = megazero_entry(ckpt.common)
    kind = _optimizer_kind(ckpt) if load_optimizer else "none"
    if kind not in ("none", "fully_reshardable", "dp_reshardable"):
        _refuse_layout(ckpt, kind)
    state = _train_state(ckpt, own, finetune, kind != "none")
    notes: list[str] = [state.pop("samples_note")] if state.get("samples_note") else []
    names = {s.name for g in engine.groups for s in g.slots}
    table = entries_for_checkpoint(ckpt, config)  # built once: a meta model of the whole config
    weights = MegatronDistSource(ckpt, config, entries=table)
    master, moments, step = None, None, None
    if kind == "fully_reshardable":
        master, moments = _optimizer_sources(ckpt, config, table, names, engine.state_keys(),
                                             engine.config.optimizer.type)
    elif kind == "dp_reshardable":
        master, moments = _dp_reshardable_sources(ckpt, engine, table, weights, engine.state_keys())
    if moments is not None:
        step, found = _read_steps(ckpt, kind, state["iteration"])
        if not found:
            notes.append(f"the optimizer's step count is not in the checkpoint: Adam continues at step {step} "
                         "(the iteration)")
    elif load_optimizer:  # Megatron-LM stops here too, rather than restart Adam's moments unasked
        raise CheckpointError(f"{ckpt.directory} holds no optimizer state (saved with --no-save-optim, or "
                              "converted): add --no-load-optim to start the optimizer afresh from its weights, or "
                              "--finetune to start a new run (iteration 0) from them")
    if state["lr_scheduler"] is None and not finetune:
        notes.append("the LR schedule is this run's own from its step 0, as Megatron-LM's (it reads "
                     "opt_param_scheduler only with the optimizer state): a warmup, if any, runs again from here")
    if moments is not None and any(o.get("grad_scaler") for o in _optimizers(ckpt.common)):
        notes.append("Megatron's fp16 loss scale is not carried over: the loss scaler starts from its initial "
                     "scale")
    load_full_weights_file(engine, weights, master=master, moments=moments, step=step, where=ckpt.directory)
    _restore_buffers(engine, weights)
    state.update(optimizer_loaded=moments is not None, bytes_read=ckpt.bytes_read, directory=ckpt.directory,
                 notes=notes, engine=(own or {}).get("engine") if moments is not None else None)
    return state
