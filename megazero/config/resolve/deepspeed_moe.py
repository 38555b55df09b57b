"""DeepSpeed-MoE's flags, as Megatron-DeepSpeed's launch scripts spell them, read as megazero's (Megatron-core's)
mixture-of-experts settings, with DeepSpeed-MoE's defaults where a script leaves them out.

A launch that uses any of ``--moe-expert-parallel-size``, ``--topk``, ``--moe-loss-coeff``,
``--expert-interval``, ``--moe-train-capacity-factor`` / ``--moe-eval-capacity-factor`` /
``--moe-min-capacity``, ``--disable-moe-token-dropping``, ``--mlp-type`` or ``--create-moe-param-group``
gets what Megatron-DeepSpeed would build: ``--num-experts 1`` is a dense model; otherwise every
``expert_interval``-th layer (1-based; default 2) is a mixture, top-1 by default (its weight the softmax
over all experts), the load-balancing loss at 0.1, and tokens over capacity dropped (factor 1.0, at least
4 per expert) unless ``--disable-moe-token-dropping``. DeepSpeed's random token selection and second-expert
sampling are not reproduced: the copies an expert keeps are those of the highest routing weights.
"""

from __future__ import annotations

import argparse

from megazero.config.train_config import ConfigError
from megazero.model.config import GPTConfig

__all__ = ["merge_deepspeed_moe", "balancing_notes"]

_SPELLINGS = {"ds_moe_expert_parallel_size": "--moe-expert-parallel-size", "ds_topk": "--topk",
              "ds_moe_loss_coeff": "--moe-loss-coeff", "ds_expert_interval": "--expert-interval",
              "ds_moe_train_capacity_factor": "--moe-train-capacity-factor",
              "ds_moe_eval_capacity_factor": "--moe-eval-capacity-factor", "ds_moe_min_capacity": "--moe-min-capacity",
              "ds_disable_moe_token_dropping": "--disable-moe-token-dropping", "ds_mlp_type": "--mlp-type",
              "ds_create_moe_param_group": "--create-moe-param-group",
              "ds_disable_top2_sampling": "--disable-moe-top2-2nd-expert-sampling"}


def _take(ns: argparse.Namespace, ds: str, ours: str, flag: str, fallback=None) -> None:
    """Set ``ours`` from DeepSpeed's ``ds`` (or its default ``fallback``); both given and different: refused."""
    value, mine = getattr(ns, ds), getattr(ns, ours)
    if value is not None and mine is not None and value != mine:
        raise ConfigError(f"{_SPELLINGS[ds]} {value} and {flag} {mine} disagree; give one of them")
    if mine is None:
        setattr(ns, ours, value if value is not None else fallback)


def _preset_layers(preset) -> int:
    """The layers of ``--model-preset`` (the shape flags are read later; the layer pattern is needed now)."""
    from megazero.model.config import PRESETS

    key = (preset or "").lower()
    key = key if key in PRESETS else "gpt-" + key
    if key not in PRESETS:
        raise ConfigError("DeepSpeed-MoE's --expert-interval places the mixtures by layer: give --num-layers "
                          "(or a --model-preset)")
    return PRESETS[key]["num_layers"]


def merge_deepspeed_moe(ns: argparse.Namespace, notes: list[str]) -> None:
    """Rewrite ``ns``'s DeepSpeed-MoE flags as megazero's (a no-op when none is given)."""
    used = [flag for dest, flag in _SPELLINGS.items() if getattr(ns, dest) is not None]
    if not used:
        return
    experts = ns.num_experts or [1]
    if len(set(experts)) > 1:
        raise ConfigError(f"--num-experts {' '.join(map(str, experts))}: DeepSpeed-MoE's per-layer expert counts are "
                          "not available; give one number of experts for every MoE layer")
    _take(ns, "ds_moe_expert_parallel_size", "expert_model_parallel_size", "--expert-model-parallel-size")
    if experts[0] == 1:  # DeepSpeed's dense model
        if (ns.expert_model_parallel_size or 1) > 1:
            raise ConfigError(f"--num-experts 1 (dense in DeepSpeed-MoE) with expert parallelism "
                              f"{ns.expert_model_parallel_size}: give --num-experts E > 1 or drop the expert parallelism")
        ns.num_experts = None
        notes.append(f"DeepSpeed-MoE flags ({', '.join(used)}) with --num-experts 1: a dense model")
        return
    interval = ns.ds_expert_interval if ns.ds_expert_interval is not None else 2
    layers = ns.num_layers if ns.num_layers is not None else _preset_layers(ns.model_preset)
    if interval < 1 or interval > layers:
        raise ConfigError(f"--expert-interval {interval} must be in 1..--num-layers {layers}")
    if ns.moe_layer_freq not in (None, 1):
        raise ConfigError("--expert-interval (DeepSpeed-MoE) and --moe-layer-freq both place the mixtures; give one")
    ns.moe_layer_freq = tuple(int((i + 1) % interval == 0) for i in range(layers))
    _take(ns, "ds_topk", "moe_router_topk", "--moe-router-topk", 1)
    if ns.moe_router_topk == 1:  # DeepSpeed's top-1 gate weighs a token by its expert's softmax over all experts
        ns.moe_router_pre_softmax = True
    _take(ns, "ds_moe_loss_coeff", "moe_aux_loss_coeff", "--moe-aux-loss-coeff", 0.1)
    if not ns.ds_disable_moe_token_dropping:
        _take(ns, "ds_moe_train_capacity_factor", "moe_expert_capacity_factor", "--moe-expert-capacity-factor", 1.0)
        ns.moe_eval_capacity_factor = ns.ds_moe_eval_capacity_factor
        ns.moe_min_capacity = ns.ds_moe_min_capacity if ns.ds_moe_min_capacity is not None else 4
    layers = ", ".join(str(i) for i, moe in enumerate(ns.moe_layer_freq) if moe)
    notes.append(f"DeepSpeed-MoE flags ({', '.join(used)}): {ns.num_experts[0]} experts in layers {layers} "
                 f"(--expert-interval {interval}), top-{ns.moe_router_topk}, "
                 + ("dropless" if ns.ds_disable_moe_token_dropping else
                    f"capacity factor {ns.moe_expert_capacity_factor} (at least {ns.moe_min_capacity}), keeping "
                    "the highest routing weights (DeepSpeed selects at random)"))


def balancing_notes(ns: argparse.Namespace, model: GPTConfig) -> list[str]:
    """A note when the mixture of experts of the resolved ``model`` (from --num-experts or the checkpoint the run
    starts from) trains with no load balancing only because of the defaults: the auxiliary loss's weight defaults
    to 0 (Megatron-LM's), and no expert bias or capacity is set. Not when the command line chose it
    (``--moe-aux-loss-coeff 0``, ``--moe-router-load-balancing-type none``)."""
    if not model.num_experts or ns.moe_aux_loss_coeff is not None or model.moe_router_load_balancing_type == "none":
        return []
    if model.moe_aux_loss_coeff or model.moe_router_enable_expert_bias or model.moe_expert_capacity_factor is not None:
        return []
    return [f"{model.num_experts} experts with no load balancing: --moe-aux-loss-coeff defaults to 0 (as in "
            "Megatron-LM), so nothing evens out the experts' loads (the log's 'expert load max over mean'); pass "
            "e.g. --moe-aux-loss-coeff 1e-2, or --moe-router-enable-expert-bias with sigmoid routing, or "
            "--moe-expert-capacity-factor"]
