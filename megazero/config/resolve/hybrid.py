"""Layers by kind: the hybrid pattern, Gated DeltaNet, KDA and Mamba-2 flags (Megatron-LM's names) -> GPTConfig
fields.

Called in order by ``arguments.parse_args``: :func:`spec_refusals` beside the flag table's refusals,
:func:`resolve_hybrid_pattern` before the required flags are checked (the pattern gives --num-layers), and
:func:`hybrid_kwargs` / :func:`check_hybrid_model` while the model is resolved. Megatron's rules: the pattern
gives the number of layers; --hybrid-override-pattern is its older name; without a pattern, the ratios (all
Mamba-2 when both are 0) under a Mamba stack --spec, as megatron-core's allocate_layers.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import Any, Optional

from megazero.config.train_config import ConfigError
from megazero.model.interop.megatron_hybrid import is_hybrid_stack_spec, pattern_from_ratios
from megazero.model.layer_pattern import check_layer_pattern, hybrid_symbols

__all__ = ["check_linear_context_parallel", "spec_refusals", "resolve_hybrid_pattern", "hybrid_kwargs", "check_hybrid_model", "HYBRID_FIELDS"]

SPEC_REFUSAL = ("layer specs given as Python import paths do not exist in megazero: every layer comes from the "
                "flags (Megatron's Mamba/hybrid stack spec is accepted, its layers coming from "
                "--hybrid-layer-pattern); drop the flag")
# GPTConfig fields the flags of this module set, each from the flag of its name
HYBRID_FIELDS = ("hybrid_layer_pattern", "experimental_attention_variant", "linear_attention_freq",
                 "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim", "linear_num_key_heads",
                 "linear_num_value_heads", "kda_f_lora_rank", "kda_gate_lora_rank", "mamba_num_heads",
                 "mamba_head_dim", "mamba_state_dim", "mamba_num_groups", "attention_output_gate")


def spec_refusals(ns: argparse.Namespace) -> list[str]:
    """The refusal line of a --spec other than Megatron's Mamba/hybrid stack spec (none otherwise)."""
    if ns.spec is None or is_hybrid_stack_spec(ns.spec):
        return []
    return [f"--spec {' '.join(ns.spec)}: {SPEC_REFUSAL}".replace("--spec : ", "--spec: ")]


def _ratios(ns: argparse.Namespace) -> tuple[float, float]:
    return float(ns.hybrid_attention_ratio or 0.0), float(ns.hybrid_mlp_ratio or 0.0)


def resolve_hybrid_pattern(ns: argparse.Namespace, notes: list[str]) -> None:
    """Set ``ns.hybrid_layer_pattern`` (from --hybrid-override-pattern, or from the ratios of a Mamba stack --spec)
    and ``ns.num_layers`` from it; refuse a pattern that cannot build, or a --num-layers that disagrees with it."""
    pattern, older = ns.hybrid_layer_pattern, ns.hybrid_override_pattern
    if pattern is not None and older is not None:
        raise ConfigError(f"--hybrid-override-pattern {older} is Megatron's older name of --hybrid-layer-pattern "
                          f"{pattern}: give one of them")
    pattern = pattern if pattern is not None else older
    attention, mlp = _ratios(ns)
    if pattern is None and (attention or mlp or is_hybrid_stack_spec(ns.spec)):
        if ns.num_layers is None:
            if attention or mlp:
                raise ConfigError(f"--hybrid-attention-ratio {attention:g} and --hybrid-mlp-ratio {mlp:g} place the "
                                  "layers of --num-layers, which is not given: give --num-layers, or the layers "
                                  "with --hybrid-layer-pattern")
            return  # a stack spec alone: the checkpoint the run starts from gives the layers, else --num-layers lacks
        try:
            pattern = pattern_from_ratios(ns.num_layers, attention, mlp)
        except ValueError as e:
            raise ConfigError(f"{e}: give --hybrid-attention-ratio and --hybrid-mlp-ratio in [0, 1] with a sum of at "
                              "most 1") from None
        notes.append(f"layers from --hybrid-attention-ratio {attention:g} and --hybrid-mlp-ratio {mlp:g} "
                     f"(megatron-core's allocation): {pattern}")
    if pattern is None:
        return
    symbols = hybrid_symbols(pattern)
    try:  # the symbols first, so a '/' or a 'D' is named as such rather than as a wrong count
        check_layer_pattern(pattern, len(symbols), None, None)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if ns.num_layers is not None and ns.num_layers != len(symbols):
        raise ConfigError(f"--num-layers {ns.num_layers} disagrees with --hybrid-layer-pattern {pattern}, which has "
                          f"{len(symbols)} layers (its symbols without '|'): give --num-layers {len(symbols)} or "
                          "leave it out")
    if attention or mlp:
        _check_ratio_counts(symbols, attention, mlp)
    ns.hybrid_layer_pattern, ns.num_layers = pattern, len(symbols)


def _check_ratio_counts(symbols: str, attention: float, mlp: float) -> None:
    """Megatron's older rule for a pattern given beside the ratios: as many layers of each kind as they place."""
    placed = Counter(pattern_from_ratios(len(symbols), attention, mlp))
    got = Counter(symbols)
    if any(placed[s] != got[s] for s in "M*-E"):
        raise ConfigError(f"--hybrid-layer-pattern has {got['M']} Mamba-2, {got['*']} attention and {got['-']} MLP "
                          f"layers but --hybrid-attention-ratio {attention:g} and --hybrid-mlp-ratio {mlp:g} place "
                          f"{placed['M']}, {placed['*']} and {placed['-']}: drop the ratios (the pattern gives the "
                          "layers)")


def hybrid_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """GPTConfig keyword arguments of the hybrid, Gated DeltaNet and Mamba-2 flags the command line set
    (``resolve_hybrid_pattern`` has run); --experimental-attention-variant gdn is gated_delta_net."""
    kw: dict[str, Any] = {name: getattr(ns, name) for name in HYBRID_FIELDS
                          if name != "attention_output_gate" and getattr(ns, name) is not None}
    if kw.get("experimental_attention_variant") == "gdn":  # Megatron's newer name
        kw["experimental_attention_variant"] = "gated_delta_net"
    if ns.attention_output_gate:
        kw["attention_output_gate"] = True
    if ns.linear_cp_comm_type is not None:
        kw["linear_cp_comm_type"] = ns.linear_cp_comm_type
    return kw


def check_hybrid_model(ns: argparse.Namespace, pattern: Optional[str]) -> None:
    """--is-hybrid-model needs the model's pattern (``pattern``: from the flags or the checkpoint)."""
    if ns.is_hybrid_model and pattern is None:
        raise ConfigError("--is-hybrid-model without a layer pattern: give the layers with --hybrid-layer-pattern (M "
                          "Mamba-2, G Gated DeltaNet, * attention, - MLP, E experts), or drop the flag for a GPT")


def check_linear_context_parallel(model, parallel) -> None:
    """Under --linear-cp-comm-type a2a each context-parallel rank takes 1/cp of a recurrent layer's heads (Gated
    DeltaNet's and KDA's key heads, Mamba-2's groups) on its tensor-parallel rank: they must divide, checked before
    any process group starts (state passing takes any number)."""
    if parallel.cp == 1 or model.linear_cp_comm_type != "a2a":
        return
    mixers = {model.layer_kinds(i).mixer for i in range(model.num_layers)}
    for kind, flag, total in (("gdn", "--linear-num-key-heads", model.linear_num_key_heads),
                              ("kda", "--linear-num-key-heads", model.linear_num_key_heads),
                              ("mamba", "--mamba-num-groups", model.mamba_num_groups)):
        if kind in mixers and (total // parallel.tp) % parallel.cp:
            raise ConfigError(f"--linear-cp-comm-type a2a splits each tensor-parallel rank's {total // parallel.tp} "
                              f"{'Mamba-2 groups' if kind == 'mamba' else 'key heads'} ({flag} {total} / --tp "
                              f"{parallel.tp}) over --context-parallel-size {parallel.cp}, which does not divide them: "
                              "use --linear-cp-comm-type state_passing (any number), or change the sizes")
