"""Muon (Megatron-LM's ``--optimizer muon``): Newton-Schulz-orthogonalised momentum on the 2-D weights
inside the transformer layers (or those tagged ``use_muon``), the auxiliary AdamW on every other
parameter. Its per-matrix step is :class:`megazero.zero.optimizers.muon_step.MuonStep`."""

from __future__ import annotations

import dataclasses
import logging

import torch.distributed as dist

from .adam import Adam
from .base import ZeroConfigError, register
from .muon_step import MuonStep

__all__ = ["Muon", "MuonConfig", "SCALE_MODES", "TP_MODES"]
logger = logging.getLogger(__name__)

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


def _given(ns, attr, fallback):
    value = getattr(ns, attr, None)
    return fallback if value is None else value


class Muon(Adam):
    """Muon on the 2-D weights inside the transformer layers (or those tagged ``use_muon``), the
    auxiliary AdamW (``betas``, ``eps``, ``adam_lr``) on every other parameter."""

    name, aliases, cli_names = "Muon", ("muon",), ("muon",)
    params = ("lr", "muon_lr", "adam_lr", "momentum", "betas", "eps", "weight_decay")
    json_flags = {"momentum": ("muon_momentum", "--muon-momentum")}  # Muon's params.momentum is its own
    summary = ("muon (the 2-D weights inside the transformer layers; embeddings, output layer, norms and biases take "
               "AdamW with the --adam-* flags)")
    per_matrix = True
    host_step = False

    def type_name(self, spelled):
        return self.name

    def config_of(self, oc) -> MuonConfig:
        """Muon's knobs (the command line's settings, else the defaults) with ``params.momentum`` applied."""
        m = oc.settings or MuonConfig()
        return m if oc.momentum is None else dataclasses.replace(m, momentum=float(oc.momentum))

    def state_keys(self, oc, matrix=False):
        return ("momentum_buffer",) if matrix else super().state_keys(oc)

    def decoupled(self, oc):
        return True  # the auxiliary optimizer is AdamW

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
        self.config_of(oc).validate()
        for key in ("muon_lr", "adam_lr"):
            value = getattr(oc, key)
            if value is not None and float(value) <= 0:
                raise ZeroConfigError(f"optimizer.params.{key} must be > 0, got {value}")

    def matrix_step(self, groups, oc, comm, tp_group, tp_rank, tp_size):
        step = MuonStep(groups, self.config_of(oc), comm, tp_group, tp_rank, tp_size)
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("Muon: %s", step.describe())
        return step

    # ------------------------------------------------------------------ command line

    def add_flags(self, g):
        H, low = "honoured", str.lower
        g(H, "--muon-momentum", "Muon's momentum (an average: m = b m + (1 - b) g)", float, default=0.95)
        g(H, ("--muon-nesterov", "--muon-use-nesterov"), "Muon: Nesterov momentum (orthogonalise (1 - b) g + b m)",
          dest="muon_nesterov")
        g(H, "--muon-num-ns-steps", "Muon: Newton-Schulz iterations (quintic, coefficients 3.4445, -4.775, 2.0315)",
          int, default=5)
        g(H, "--muon-scale-mode", "Muon's update scale for an out x in matrix: spectral sqrt(max(out, in)), "
          "unit_rms_norm sqrt(out/in), shape_scaling sqrt(max(1, out/in))", low,
          choices=("spectral", "unit_rms_norm", "shape_scaling"), default="spectral")
        g(H, "--muon-extra-scale-factor", "Muon: a further factor on the update (Moonlight's 0.2 matches AdamW's "
          "RMS with spectral)", float, default=1.0)
        g(H, "--muon-split-qkv", "Muon: orthogonalise the fused QKV weight as its Q, K and V matrices apart (the "
          "default)", dest="muon_split_qkv")
        g(H, "--muon-no-split-qkv", "Muon: orthogonalise the fused QKV weight as one matrix", dest="muon_split_qkv",
          store_false=True)
        g(H, "--muon-tp-mode", "Muon on TP-sharded matrices: duplicated (each owner gathers the whole matrix), "
          "distributed (the owners run Newton-Schulz on their TP blocks together, summing Gram matrices over TP: "
          "nothing gathered, no TP rank repeats the others' work); both equal one process; blockwise (Newton-Schulz "
          "on each TP block: the update depends on the TP size)", low, choices=("duplicated", "blockwise",
                                                                                "distributed"), default="duplicated")
        g(H, "--muon-scalar-optimizer", "the optimizer of the parameters Muon does not take: adam (AdamW)", low,
          choices=("adam", "lion"), default="adam",
          refuse_values=(("lion", "--muon-scalar-optimizer lion: Muon's other parameters take AdamW in megazero; "
                                  "use adam"),))
        g(H, "--muon-fp32-matmul-prec", "torch's float32 matmul precision inside Newton-Schulz (medium/high allow "
          "TF32/bf16 passes on GPUs)", low, choices=("highest", "high", "medium", "low"), default="highest",
          refuse_values=(("low", "--muon-fp32-matmul-prec low: torch's float32 matmul precision is highest, high "
                                 "or medium; pass one of them"),))
        g(H, "--muon-ns-dtype", "Muon: the dtype Newton-Schulz runs in (bf16 is torch.optim.Muon's)", low,
          choices=("fp32", "bf16"), default="fp32")

    def flag_dests(self):
        return ("muon_momentum", "muon_nesterov", "muon_num_ns_steps", "muon_scale_mode", "muon_extra_scale_factor",
                "muon_split_qkv", "muon_tp_mode", "muon_scalar_optimizer", "muon_fp32_matmul_prec", "muon_ns_dtype")

    def settings(self, ns):
        return MuonConfig(
            momentum=_given(ns, "muon_momentum", 0.95), nesterov=bool(getattr(ns, "muon_nesterov", None)),
            ns_steps=_given(ns, "muon_num_ns_steps", 5), scale_mode=_given(ns, "muon_scale_mode", "spectral"),
            extra_scale_factor=_given(ns, "muon_extra_scale_factor", 1.0),
            split_qkv=_given(ns, "muon_split_qkv", True), tp_mode=_given(ns, "muon_tp_mode", "duplicated"),
            ns_dtype=_given(ns, "muon_ns_dtype", "fp32"),
            fp32_matmul_precision=_given(ns, "muon_fp32_matmul_prec", "highest")).validate()

    def describe(self, o):
        adam = f"betas ({o.adam_beta1}, {o.adam_beta2}) eps {o.adam_eps:g}"
        if o.settings is None:
            return f"{o.type} {adam}"
        m = o.settings
        return (f"Muon momentum {m.momentum}{' (Nesterov)' if m.nesterov else ''}, {m.ns_steps} Newton-Schulz steps "
                f"on the layers' matrices, AdamW {adam} on the rest")


register(Muon())
