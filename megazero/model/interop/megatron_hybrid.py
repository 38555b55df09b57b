"""Megatron-LM's arguments of models with Mamba-2, Gated DeltaNet, Kimi Delta Attention and attention layers, both
ways.

* :func:`pattern_from_ratios`: the layers Megatron builds from ``--hybrid-attention-ratio`` and
  ``--hybrid-mlp-ratio`` (megatron-core's ``allocate_layers``, later ``pattern_from_ratios``) when no pattern
  is given: attention evenly spaced, starting and ending with Mamba-2, then MLPs among the Mamba-2 layers.
* :func:`is_hybrid_stack_spec`: whether a ``--spec`` names Megatron's Mamba/hybrid stack spec.
* :func:`hybrid_args` / :func:`hybrid_fields`: a ``GPTConfig``'s per-layer kinds as Megatron's ``args`` and
  back (``hybrid_layer_pattern``, Megatron's older ``hybrid_override_pattern``, or the ratios of a Mamba
  stack spec; ``experimental_attention_variant``, ``linear_*``, ``kda_*``, ``mamba_*``, ``attention_output_gate``).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from ..config import GPTConfig
from ..layer_pattern import hybrid_symbols

__all__ = ["pattern_from_ratios", "is_hybrid_stack_spec", "hybrid_args", "hybrid_fields", "MAMBA_STACK_SPEC"]

# The --spec a Megatron hybrid run gives (megatron.core.models.mamba is kept beside .hybrid in newer releases)
MAMBA_STACK_SPEC = ["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
_GDN = ("gated_delta_net", "gdn")  # Megatron's names of Gated DeltaNet ('gated_delta_net' its older one)
_LINEAR = ("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
           "linear_num_value_heads")
_MAMBA = ("mamba_num_heads", "mamba_head_dim", "mamba_state_dim", "mamba_num_groups")
_KDA = ("kda_f_lora_rank", "kda_gate_lora_rank")  # None (Megatron's default) is a full-rank projection


def pattern_from_ratios(num_layers: int, attention_ratio: float = 0.0, mlp_ratio: float = 0.0) -> str:
    """Megatron's layer allocation: round(L x attention_ratio) attention layers ('*') evenly spaced among Mamba-2
    layers ('M'), then round(L x mlp_ratio) of the Mamba-2 layers made MLPs ('-'), right-justified. Both 0: all
    Mamba-2. Raises ValueError for ratios outside [0, 1] or summing above 1."""
    if num_layers < 1 or not (0.0 <= attention_ratio <= 1.0 and 0.0 <= mlp_ratio <= 1.0
                              and attention_ratio + mlp_ratio <= 1.0):
        raise ValueError(f"hybrid attention ratio {attention_ratio:g} and MLP ratio {mlp_ratio:g} must each be in "
                         f"[0, 1] with a sum of at most 1, for num_layers >= 1 (got {num_layers})")
    layers = ["M"] * num_layers
    attention = round(num_layers * attention_ratio)
    mamba = num_layers - attention
    section = mamba / (attention + 1)
    x = section
    for i in range(num_layers):
        if x < 0.5:
            layers[i] = "*"
            x += section
        else:
            x -= 1
    mlp = round(num_layers * mlp_ratio)
    if mlp > 0:
        per_mlp = (mamba - mlp) / mlp
        x = per_mlp
        for i in range(num_layers):
            if layers[i] == "M":
                if x < 0.5:
                    layers[i] = "-"
                    x += per_mlp
                else:
                    x -= 1
    return "".join(layers)


def is_hybrid_stack_spec(spec: Optional[Sequence[str]]) -> bool:
    """Whether Megatron's ``--spec`` words name its Mamba/hybrid stack spec (a word containing 'mamba' or
    'hybrid', e.g. ``megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec``)."""
    return bool(spec) and any("mamba" in w.lower() or "hybrid" in w.lower() for w in spec)


def hybrid_args(config: GPTConfig) -> dict[str, Any]:
    """Megatron-LM's argument names and values for ``config``'s per-layer kinds (none for a model of attention
    layers only but ``attention_output_gate``)."""
    args: dict[str, Any] = dict(attention_output_gate=config.attention_output_gate)
    pattern = config.hybrid_layer_pattern
    if pattern is not None:
        # Megatron-LM's name, its older one (which has no '|' cuts) and the stack spec its pretrain_hybrid.py needs
        args.update(hybrid_layer_pattern=pattern, hybrid_override_pattern=hybrid_symbols(pattern),
                    is_hybrid_model=True, spec=list(MAMBA_STACK_SPEC))
    if config.experimental_attention_variant is not None:
        freq = config.linear_attention_freq
        args.update(experimental_attention_variant=config.experimental_attention_variant,
                    linear_attention_freq=list(freq) if isinstance(freq, tuple) else freq)
    kinds = {config.layer_kinds(i).mixer for i in range(config.num_layers)}
    if "gdn" in kinds or "kda" in kinds:
        args.update({name: getattr(config, name) for name in _LINEAR})
    if "kda" in kinds:
        args.update({name: getattr(config, name) for name in _KDA})
    if "mamba" in kinds:
        args.update({name: getattr(config, name) for name in _MAMBA + ("linear_conv_kernel_dim",)})
    return args


def _get(args: Any, name: str) -> Any:
    return getattr(args, name, None)


def hybrid_fields(args: Any) -> dict[str, Any]:
    """GPTConfig's per-layer kind fields from a Megatron ``args`` Namespace: the pattern (``hybrid_layer_pattern``,
    else ``hybrid_override_pattern``, else the ratios of a Mamba stack ``spec``; with it ``num_layers``), Gated
    DeltaNet's and Mamba-2's sizes where given, and the attention output gate. Empty for a GPT's args."""
    out: dict[str, Any] = {}
    pattern = _get(args, "hybrid_layer_pattern") or _get(args, "hybrid_override_pattern")
    ratios = (float(_get(args, "hybrid_attention_ratio") or 0.0), float(_get(args, "hybrid_mlp_ratio") or 0.0))
    if pattern is None and (any(ratios) or is_hybrid_stack_spec(_get(args, "spec"))):
        pattern = pattern_from_ratios(int(args.num_layers), *ratios)
    if pattern is not None:
        out.update(hybrid_layer_pattern=pattern, num_layers=len(hybrid_symbols(pattern)))
    variant = _get(args, "experimental_attention_variant")
    if variant is not None:
        out["experimental_attention_variant"] = "gated_delta_net" if variant in _GDN else variant
    freq = _get(args, "linear_attention_freq")
    if freq is not None:
        out["linear_attention_freq"] = tuple(int(f) for f in freq) if isinstance(freq, (list, tuple)) else int(freq)
    for name in _LINEAR + _MAMBA + _KDA:
        if _get(args, name) is not None:
            out[name] = int(_get(args, name))
    if _get(args, "attention_output_gate"):
        out["attention_output_gate"] = True
    return out
