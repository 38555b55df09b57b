"""What an optimizer component is, and the registry of them.

A component (a subclass of :class:`Optimizer`, one file each beside this one, registered with
:func:`register`) says

* its names: in a DeepSpeed ``optimizer.type`` (``name``, ``aliases``) and after ``--optimizer``
  (``cli_names``); the ``optimizer.params`` keys it takes (:func:`parse_optimizer` refuses the
  others) and its defaults for them;
* its own command-line flags (:meth:`Optimizer.add_flags`) and the settings object it makes of them
  (:meth:`Optimizer.settings`; the run's ``OptimConfig.settings`` carries it unopened);
* its state tensors beside each fp32 master, their bytes per element and their names on
  tensorboard (checkpoints reshard them like the master; the planner counts their bytes);
* its update: the torch kernel over the flat fp32 shards (:meth:`Optimizer.build`, elementwise) and,
  for parameters it needs whole (:meth:`Optimizer.takes_matrix`), a per-matrix step the engine runs
  after the kernel (:meth:`Optimizer.matrix_step`; Muon's goes through ``matrix_exchange.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional, Protocol

import torch

__all__ = ["ZeroConfigError", "OptimizerConfig", "Optimizer", "MatrixStep", "register", "component", "registered",
           "cli_names", "parse_optimizer"]


class ZeroConfigError(ValueError):
    """A ZeRO configuration that cannot work; the message names the key."""


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """DeepSpeed's ``optimizer`` block: ``type`` and the ``params`` keys (one field each), and the
    component's own settings from the command line (``settings``, opaque here)."""

    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # DeepSpeed's "Adam" is decoupled (AdamW) unless adam_w_mode is false.
    adam_w_mode: bool = True
    torch_adam: bool = False
    momentum: Optional[float] = None  # a momentum parameter's (None: the component's default)
    muon_lr: Optional[float] = None  # Muon: its matrices' lr (None: lr)
    adam_lr: Optional[float] = None  # Muon: the auxiliary AdamW's lr (None: lr)
    settings: Any = None  # the component's own (Optimizer.settings), None: its defaults

    @property
    def component(self) -> "Optimizer":
        return component(self.type)


class MatrixStep(Protocol):
    """A per-matrix update over the engine's ``per_matrix`` flat groups (Muon's: ``zero/optimizers/muon_step.py``)."""

    def step(self, grads: dict, coef: float, optimizer: torch.optim.Optimizer) -> None:
        """Update the masters from ``grads`` (each group's reduced partition) scaled by ``coef``."""


class Optimizer:
    """One optimizer: its names, ``optimizer.params`` keys, flags, state and update rule."""

    name = ""
    aliases: tuple[str, ...] = ()
    cli_names: tuple[str, ...] = ()  # its --optimizer values
    summary = ""  # its --optimizer values as the flag's help describes them
    params: tuple[str, ...] = ("lr", "weight_decay")
    param_defaults: dict[str, Any] = {}  # optimizer.params values other than OptimizerConfig's defaults
    param_hints: dict[str, str] = {}  # a key of other optimizers' params -> where this one keeps that value
    json_flags: dict[str, tuple[str, str]] = {}  # optimizer.params key -> (namespace attribute, flag) it merges into
    per_matrix = False  # updates some parameters as whole matrices (takes_matrix decides which)
    host_step = False  # zero_optimization.offload_optimizer can step it on the host

    def default_config(self) -> OptimizerConfig:
        """Its configuration with every value at its default (what the planner sizes)."""
        return parse_optimizer(self.name, {})

    def spelled_params(self, spelled: str) -> dict[str, Any]:
        """``optimizer.params`` values that the type's spelling ``spelled`` implies."""
        return {}

    def type_name(self, spelled: str) -> str:
        """The ``OptimizerConfig.type`` of a block spelled ``spelled``."""
        return self.name

    def state_keys(self, oc: OptimizerConfig, matrix: bool = False) -> tuple[str, ...]:
        """The per-element state tensors beside a master (saved and resharded like the master)."""
        raise NotImplementedError

    def state_bytes(self, oc: OptimizerConfig, matrix: bool = False) -> int:
        """Bytes per element of that state (fp32), the master not included."""
        return 4 * len(self.state_keys(oc, matrix))

    def state_stats(self) -> tuple[tuple[str, Callable[[dict], Optional[torch.Tensor]]], ...]:
        """(tensorboard name, state dict -> tensor or None) of the state --log-optimizer-states-to-tensorboard
        shows beside the weights."""
        return ()

    def check(self, oc: OptimizerConfig) -> None:
        """Refuse values out of range (``ZeroConfigError`` naming the key)."""

    def takes_matrix(self, param: torch.nn.Parameter, in_layer: bool, name: str) -> bool:
        """Whether ``param`` (``name``; ``in_layer``: inside a transformer layer) is updated as a whole
        matrix rather than elementwise."""
        return False

    def build(self, param_groups: list[dict], oc: OptimizerConfig, device: torch.device,
              mixed_devices: bool) -> torch.optim.Optimizer:
        """The elementwise kernel over ``param_groups`` (flat fp32 masters on ``device``; ``mixed_devices``:
        some on the host). It steps the tensors that carry a ``.grad``."""
        raise NotImplementedError

    def matrix_step(self, groups: list, oc: OptimizerConfig, comm: Any, tp_group: Any, tp_rank: int,
                    tp_size: int) -> Optional[MatrixStep]:
        """The update of the ``per_matrix`` flat groups ``groups`` (None: the component has none)."""
        return None

    # ------------------------------------------------------------------ command line

    def add_flags(self, g: Callable[..., Any]) -> None:
        """Add the component's own rows to the flag table (``g`` as in ``megazero/config/flags.py``)."""

    def flag_dests(self) -> tuple[str, ...]:
        """The namespace attributes of those flags (refused with another optimizer)."""
        return ()

    def settings(self, ns: Any) -> Any:
        """The component's settings from the parsed command line ``ns`` (raises ``ZeroConfigError``)."""
        return None

    def engine_config(self, o: Any, params: dict[str, Any]) -> OptimizerConfig:
        """The engine's :class:`OptimizerConfig` from the run's ``OptimConfig`` ``o`` (the command line's
        values win) and the DeepSpeed JSON's ``optimizer.params``."""
        return dataclasses.replace(parse_optimizer(o.type, params), lr=o.lr, betas=(o.adam_beta1, o.adam_beta2),
                                   eps=o.adam_eps, weight_decay=o.weight_decay, momentum=None, settings=o.settings)

    def describe(self, o: Any) -> str:
        """The optimizer and its own settings, as the start-up line shows them."""
        return f"{o.type} betas ({o.adam_beta1}, {o.adam_beta2}) eps {o.adam_eps:g}"


_REGISTRY: list[Optimizer] = []  # registration order: the order --optimizer and the docs list them


def register(c: Optimizer) -> Optimizer:
    """Add ``c`` to the components :func:`component` finds; returns it."""
    _REGISTRY.append(c)
    return c


def registered() -> tuple[Optimizer, ...]:
    return tuple(_REGISTRY)


def cli_names() -> tuple[str, ...]:
    """Every registered ``--optimizer`` value."""
    return tuple(n for c in _REGISTRY for n in c.cli_names)


def component(type_name: str) -> Optimizer:
    """The component named ``type_name`` (DeepSpeed's spellings or an --optimizer value, any case)."""
    key = str(type_name).lower()
    for c in _REGISTRY:
        if key == c.name.lower() or key in c.aliases:
            return c
    names = ", ".join(n for c in _REGISTRY for n in (c.name,) + tuple(a for a in c.aliases if a != c.name.lower()))
    raise ZeroConfigError(f"optimizer.type {type_name!r} is not supported; use one of {names}")


def parse_optimizer(opt_type: str, params: dict[str, Any]) -> OptimizerConfig:
    """DeepSpeed's ``optimizer`` block (``type`` and ``params``) as a checked :class:`OptimizerConfig`;
    a key the named optimizer does not take is refused with the ones it does."""
    c = component(opt_type)
    fields = dict(params)
    for key in fields:
        if key not in c.params:
            owners = " and ".join(f"{o.name}'s" for o in _REGISTRY if key in o.params)
            hint = f" (it is {owners}{c.param_hints.get(key, '')})" if owners else ""
            raise ZeroConfigError(f"unknown key optimizer.params.{key} for optimizer.type {opt_type!r}{hint}; "
                                  f"{c.name} takes {', '.join(c.params)}")
    fields = {**c.param_defaults, **fields}
    if "betas" in fields:
        fields["betas"] = tuple(float(b) for b in fields["betas"])
    type_name = c.type_name(opt_type)
    fields.update(c.spelled_params(opt_type))
    oc = OptimizerConfig(type=type_name, **fields)
    c.check(oc)
    return oc
