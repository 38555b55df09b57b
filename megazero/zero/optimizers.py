"""Optimizer components: each optimizer the engine runs, defined in one place.

A component (:class:`Optimizer`, one per entry of :data:`COMPONENTS`) says

* its names in a DeepSpeed ``optimizer.type`` and the ``optimizer.params`` keys it takes
  (:func:`parse_optimizer` refuses the others, naming the component);
* its state tensors beside each fp32 master and their bytes per element (checkpoints and the
  planner read them from here);
* which parameters it updates *per matrix* (it needs each whole matrix, with its global shape:
  Muon) and which elementwise (any flat shard will do: Adam, SGD, Muon's auxiliary AdamW);
* the torch kernel that steps its elementwise parameters (:mod:`megazero.zero.optim`).

Per-matrix parameters are stepped by the engine (:mod:`megazero.zero.muon`): their flat masters
stay partitioned as ZeRO keeps them, and the optimizer object lists them too (one state dict, one
set of hyper-parameters); its kernel skips them, since they carry no ``.grad`` at its step.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import torch

__all__ = ["ZeroConfigError", "MuonConfig", "OptimizerConfig", "Optimizer", "COMPONENTS", "component",
           "parse_optimizer", "SCALE_MODES", "TP_MODES"]


class ZeroConfigError(ValueError):
    """A ZeRO configuration that cannot work; the message names the key."""


SCALE_MODES = ("shape_scaling", "spectral", "unit_rms_norm")
TP_MODES = ("duplicated", "blockwise", "distributed")
NS_DTYPES = ("fp32", "bf16")
MATMUL_PRECISIONS = ("highest", "high", "medium")


@dataclasses.dataclass(frozen=True)
class MuonConfig:
    """Muon's own knobs (Megatron-LM's ``--muon-*`` flags; the defaults are ``torch.optim.Muon``'s).

    The update of a matrix ``W`` (``out x in``, its global tp = 1 shape) from its gradient ``g``:
    ``m = momentum * m + (1 - momentum) * g``; ``u = (1 - momentum) * g + momentum * m`` with
    ``nesterov`` (else ``u = m``); ``O = NS(u)``, ``ns_steps`` quintic Newton-Schulz iterations
    with ``ns_coefficients`` on ``u / max(||u||_F, eps)`` in ``ns_dtype``;
    ``W <- W * (1 - lr * weight_decay) - lr * scale(out, in) * extra_scale_factor * O``, where
    ``scale`` is ``shape_scaling`` sqrt(max(1, out/in)) (``torch.optim.Muon``'s "original"),
    ``spectral`` sqrt(max(out, in)) or ``unit_rms_norm`` sqrt(out/in). ``split_qkv``: a fused
    QKV weight is orthogonalised as its Q, K and V matrices apart. ``tp_mode``: ``duplicated``
    gathers a TP-sharded matrix whole; ``distributed`` runs the iteration on the TP blocks together,
    summing Gram matrices over TP (both equal one process); ``blockwise`` runs Newton-Schulz on each TP
    shard (a different update at each TP size).
    """

    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = 5
    ns_coefficients: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)
    eps: float = 1e-7
    scale_mode: str = "shape_scaling"
    extra_scale_factor: float = 1.0
    split_qkv: bool = False
    tp_mode: str = "duplicated"
    ns_dtype: str = "bf16"
    fp32_matmul_precision: str = "highest"

    def validate(self) -> "MuonConfig":
        for value, allowed, flag in ((self.scale_mode, SCALE_MODES, "--muon-scale-mode"),
                                     (self.tp_mode, TP_MODES, "--muon-tp-mode"),
                                     (self.ns_dtype, NS_DTYPES, "Newton-Schulz dtype"),
                                     (self.fp32_matmul_precision, MATMUL_PRECISIONS, "--muon-fp32-matmul-prec")):
            if value not in allowed:
                raise ZeroConfigError(f"{flag} {value!r} is not one of {', '.join(allowed)}")
        if not 0.0 <= self.momentum < 1.0:
            raise ZeroConfigError(f"Muon's momentum must be in [0, 1), got {self.momentum}")
        if not 1 <= self.ns_steps < 100:
            raise ZeroConfigError(f"Muon's Newton-Schulz steps must be in [1, 100), got {self.ns_steps}")
        if self.extra_scale_factor <= 0:
            raise ZeroConfigError(f"--muon-extra-scale-factor must be > 0, got {self.extra_scale_factor}")
        return self


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """DeepSpeed's ``optimizer`` block: ``type`` and the ``params`` keys (one field each), and
    Muon's knobs (``muon``, set from Megatron's flags)."""

    type: str = "AdamW"
    lr: float = 1e-3
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    # DeepSpeed's "Adam" is decoupled (AdamW) unless adam_w_mode is false.
    adam_w_mode: bool = True
    torch_adam: bool = False
    momentum: Optional[float] = None  # SGD's (default 0) and Muon's (default MuonConfig.momentum)
    muon_lr: Optional[float] = None  # Muon: its matrices' lr (None: lr)
    adam_lr: Optional[float] = None  # Muon: the auxiliary AdamW's lr (None: lr)
    muon: Optional[MuonConfig] = None  # type Muon: its knobs (None: the defaults)

    @property
    def component(self) -> "Optimizer":
        return component(self.type)

    @property
    def muon_config(self) -> MuonConfig:
        """Muon's knobs with ``params.momentum`` applied."""
        m = self.muon or MuonConfig()
        return m if self.momentum is None else dataclasses.replace(m, momentum=float(self.momentum))


class Optimizer:
    """One optimizer: its names, ``optimizer.params`` keys, state and update rule."""

    name = ""
    aliases: tuple[str, ...] = ()
    params: tuple[str, ...] = ("lr", "weight_decay")
    per_matrix = False  # updates some parameters as whole matrices (takes_matrix decides which)
    host_step = False  # zero_optimization.offload_optimizer can step it on the host

    def state_keys(self, oc: OptimizerConfig, matrix: bool = False) -> tuple[str, ...]:
        """The per-element state tensors beside a master (saved and resharded like the master)."""
        raise NotImplementedError

    def state_bytes(self, oc: OptimizerConfig, matrix: bool = False) -> int:
        """Bytes per element of that state (fp32), the master not included."""
        return 4 * len(self.state_keys(oc, matrix))

    def check(self, oc: OptimizerConfig) -> None:
        """Refuse values out of range (``ZeroConfigError`` naming the key)."""

    def takes_matrix(self, param: torch.nn.Parameter, in_layer: bool, name: str) -> bool:
        """Whether ``param`` (``name``; ``in_layer``: inside a transformer layer) is updated as a whole
        matrix rather than elementwise."""
        return False


class Adam(Optimizer):
    name, aliases = "AdamW", ("adamw", "adam", "fusedadam")
    params = ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam")
    host_step = True

    def state_keys(self, oc, matrix=False):
        return ("exp_avg", "exp_avg_sq")


class SGD(Optimizer):
    name, aliases = "SGD", ("sgd",)
    params = ("lr", "weight_decay", "momentum")

    def state_keys(self, oc, matrix=False):
        return ("momentum_buffer",) if oc.momentum else ()  # torch's SGD keeps no buffer without momentum

    def check(self, oc):
        if not 0.0 <= float(oc.momentum or 0.0) < 1.0:
            raise ZeroConfigError(f"optimizer.params.momentum must be in [0, 1), got {oc.momentum}")


class Muon(Optimizer):
    """Muon on the 2-D weights inside the transformer layers (or those tagged ``use_muon``), the
    auxiliary AdamW (``betas``, ``eps``, ``adam_lr``) on every other parameter."""

    name, aliases = "Muon", ("muon",)
    params = ("lr", "muon_lr", "adam_lr", "momentum", "betas", "eps", "weight_decay")
    per_matrix = True

    def state_keys(self, oc, matrix=False):
        return ("momentum_buffer",) if matrix else Adam.state_keys(Adam(), oc)

    def takes_matrix(self, param, in_layer, name):
        """DeepSpeed's ``param.use_muon`` when set, else a 2-D weight inside a transformer layer
        (embeddings, the output layer, norms and biases take the auxiliary AdamW)."""
        tag = getattr(param, "use_muon", None)
        if tag is None:
            return param.dim() == 2 and in_layer
        if tag and param.dim() != 2:
            raise ZeroConfigError(f"{name} is tagged use_muon but has shape {tuple(param.shape)}: Muon "
                                  f"orthogonalises 2-D matrices; set use_muon = False on it (it then takes the "
                                  f"auxiliary AdamW)")
        return bool(tag)

    def check(self, oc):
        oc.muon_config.validate()
        for key in ("muon_lr", "adam_lr"):
            value = getattr(oc, key)
            if value is not None and float(value) <= 0:
                raise ZeroConfigError(f"optimizer.params.{key} must be > 0, got {value}")


COMPONENTS: tuple[Optimizer, ...] = (Adam(), SGD(), Muon())


def component(type_name: str) -> Optimizer:
    """The component named ``type_name`` (DeepSpeed's spellings, any case)."""
    key = str(type_name).lower()
    for c in COMPONENTS:
        if key == c.name.lower() or key in c.aliases:
            return c
    names = ", ".join(n for c in COMPONENTS for n in (c.name,) + tuple(a for a in c.aliases if a != c.name.lower()))
    raise ZeroConfigError(f"optimizer.type {type_name!r} is not supported; use one of {names}")


def parse_optimizer(opt_type: str, params: dict[str, Any]) -> OptimizerConfig:
    """DeepSpeed's ``optimizer`` block (``type`` and ``params``) as a checked :class:`OptimizerConfig`;
    a key the named optimizer does not take is refused with the ones it does."""
    c = component(opt_type)
    fields = dict(params)
    for key in fields:
        if key not in c.params:
            hint = " (it is SGD's and Muon's; Adam's momentum is betas[0])" if key == "momentum" else ""
            raise ZeroConfigError(f"unknown key optimizer.params.{key} for optimizer.type {opt_type!r}{hint}; "
                                  f"{c.name} takes {', '.join(c.params)}")
    if "betas" in fields:
        fields["betas"] = tuple(float(b) for b in fields["betas"])
    type_name = c.name if not isinstance(c, Adam) else str(opt_type)  # Adam keeps the file's spelling
    if str(opt_type).lower() == "adamw":  # DeepSpeed: "Adam" is AdamW unless adam_w_mode is false
        fields["adam_w_mode"] = True
    oc = OptimizerConfig(type=type_name, **fields)
    c.check(oc)
    return oc
