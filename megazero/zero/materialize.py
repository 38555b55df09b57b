"""Sharded initialization: each rank draws only the part of the model it keeps.

A model built on the meta device is initialized here, module by module in
``modules()`` order (the order of ``mpu.reset_parameters_in_order``). Each
module's ``reset_parameters()`` first runs in *recording* mode: the mpu init
path (``initialize_sharded_``) and in-place ``fill_``/``zero_``/``normal_`` on
the parameters are captured as :class:`~megazero.mpu.initializers.InitSpec`s
instead of being executed. Then every parameter's owned slice is drawn from its
spec: the whole TP shard where the group keeps full compute parameters (ZeRO
0-2, persistent ZeRO-3 parameters), only the DP partition for ZeRO-3. Normal
values come from the counter-based generator keyed by parameter name, so they
equal those of ``GPTModel(config)`` at tp=1 (at any tp x dp x stage).

A module whose initialization cannot be captured (another in-place op, e.g.
``nn.Linear``'s ``kaiming_uniform_``) is initialized for real, whole, from the
default generator, and sliced, as before: correct, but O(module) per rank.

On the meta device (``megazero.observe.rehearsal``) captured values are not drawn at all:
the partitions have shapes and no memory.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ..mpu.initializers import (
    InitSpec,
    modules_with_direct_parameters,
    naming_key,
    parameter_naming,
    recording_init_specs,
)
from .flat import FlatGroup, ParamSlot

__all__ = ["materialize_partitions", "bind_parameters"]

_UNSUPPORTED = object()


class _InPlaceRecorder(TorchFunctionMode):
    """Turns in-place initialization of the watched (meta) parameters into specs (keyed by ``id``, as
    :func:`~megazero.mpu.initializers.recording_init_specs` keys the specs it records)."""

    def __init__(self, watched: set[torch.nn.Parameter], specs: dict) -> None:
        super().__init__()
        self.watched, self.specs = watched, specs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        target = args[0] if args else None
        name = getattr(func, "__name__", "")
        if isinstance(target, torch.Tensor) and target in self.watched and name.endswith("_") \
                and not name.startswith("__"):
            shape, key = tuple(target.shape), id(target)
            if name == "zero_":
                self.specs[key] = InitSpec("fill", shape, value=0.0)
            elif name == "fill_" and len(args) > 1 and not isinstance(args[1], torch.Tensor):
                self.specs[key] = InitSpec("fill", shape, value=float(args[1]))
            elif name == "normal_" and kwargs.get("generator") is None:
                mean = args[1] if len(args) > 1 else kwargs.get("mean", 0.0)
                std = args[2] if len(args) > 2 else kwargs.get("std", 1.0)
                self.specs[key] = InitSpec("normal", shape, std=float(std), mean=float(mean))
            else:
                self.specs[key] = _UNSUPPORTED
            return target
        return func(*args, **kwargs)


def _write_owned(g: FlatGroup, s: ParamSlot, values: torch.Tensor) -> None:
    """Put the owned elements of ``s`` (already sliced to ``owned_range``) into the partition."""
    _, s0, n = g.owned_range(s)
    g.master[s0:s0 + n].copy_(values)
    if g.master is not g.shard:
        g.shard[s0:s0 + n].copy_(values)


@torch.no_grad()
def materialize_partitions(module: torch.nn.Module, groups: list[FlatGroup],
                           slot_of: dict[torch.nn.Parameter, tuple[FlatGroup, ParamSlot]],
                           device: torch.device) -> None:
    """Move parameter values into the flat groups (allocated here; the engine binds them after).

    ``slot_of`` maps each parameter to its group and slot; meta parameters are replaced
    by real ones (keeping Megatron's attributes) and ``slot_of`` is updated.
    """
    for g in groups:
        g.allocate()
    on_meta = any(s.param.is_meta for g in groups for s in g.slots)
    if on_meta:
        _initialize_from_meta(module, slot_of, device)
    else:
        for g in groups:
            for s in g.slots:
                g.load_param_values(s, s.param.data)


def _initialize_from_meta(module: torch.nn.Module, slot_of: dict, device: torch.device) -> None:
    # mpu's name-keyed draws (parameter_naming) and its recorded specs key parameters by id
    names = {id(p): s.name for p, (_, s) in slot_of.items()}
    replaced: dict[torch.nn.Parameter, torch.nn.Parameter] = {}  # meta parameter -> its real one (tied ones once)
    with parameter_naming(names) as naming:
        for m in modules_with_direct_parameters(module):
            reset = getattr(m, "reset_parameters", None)
            if reset is None:
                raise TypeError(f"{type(m).__name__} was built on the meta device but has no reset_parameters(); "
                                "give it one so ZeRO can initialize it partition by partition")
            params = list(m.named_parameters(recurse=False))
            own = list(dict.fromkeys(p for _, p in params if p not in replaced))
            if not own:
                for attr, p in params:
                    setattr(m, attr, replaced[p])
                continue
            specs: dict = {}
            with recording_init_specs(specs), _InPlaceRecorder(set(own), specs):
                reset()
            own_specs = [specs.get(id(p)) for p in own]
            captured = all(spec not in (None, _UNSUPPORTED) for spec in own_specs)
            for attr, p in params:
                if p not in replaced:
                    # A meta tensor cannot take real storage in place: swap in a new Parameter that
                    # keeps the Megatron attributes, and point the flat group at it. Captured ones
                    # need no storage of their own: the group binds views (or releases) later.
                    data = torch.empty(0 if captured else p.shape, dtype=torch.float32, device=device)
                    new = torch.nn.Parameter(data, requires_grad=p.requires_grad)
                    new.__dict__.update(p.__dict__)
                    g, s = slot_of.pop(p)
                    s.param = new
                    slot_of[new] = (g, s)
                    names[id(new)] = s.name
                    replaced[p] = new
                setattr(m, attr, replaced[p])
            if captured:
                for p, spec in zip(own, own_specs):
                    g, s = slot_of[replaced[p]]
                    key = naming_key(naming, s.name) if spec.kind == "normal" else None
                    if g.device.type == "meta":
                        continue  # a meta partition holds no values: nothing to draw (a rehearsal)
                    if g.resident:  # the group keeps the whole TP shard in compute precision
                        g.load_param_values(s, spec.draw(key, 0, s.numel).view(s.shape))
                    else:
                        p0, _, n = g.owned_range(s)
                        if n:
                            _write_owned(g, s, spec.draw(key, p0, p0 + n))
            else:
                reset()  # for real, from the default generator, on full-size tensors of this module
                for p in own:
                    new = replaced[p]
                    g, s = slot_of[new]
                    g.load_param_values(s, new.data)
                    new.data = torch.empty(0, device=device)


def bind_parameters(module: torch.nn.Module, groups: list[FlatGroup], device: torch.device) -> None:
    """Point every parameter at its group's full buffer (ZeRO-3 groups start released); refuse buffers
    still on the meta device (except in a rehearsal on the meta device, which holds meta buffers)."""
    for g in groups:
        g.bind()
    for name, b in module.named_buffers():
        if b.is_meta and device.type != "meta":
            raise TypeError(f"buffer {name} is still on the meta device; create it in the module's "
                            "reset_parameters() or compute it lazily in forward")
