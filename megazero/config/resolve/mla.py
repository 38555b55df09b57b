"""Multi-latent attention, RoPE scaling (YaRN) and multi-token prediction: GPTConfig fields from Megatron's flags.

Megatron's pretrain_gpt.py builds MLATransformerConfig from its argparse values, so the defaults in force are
the flags' (--kv-lora-rank 32, --rotary-scaling-factor 1.0, ...), not the dataclass's; YaRN's original context
and betas have no flag there under MLA and keep MLATransformerConfig's 4096, 32 and 1, which are GPTConfig's.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional

from megazero.config.resolve.common import default, same_value
from megazero.config.train_config import ConfigError

__all__ = ["mla_kwargs", "given_mla_fields", "MLA_FLAG_DEFAULTS"]

# Megatron-LM's argparse defaults (megatron/training/arguments.py, _add_mla_args).
MLA_FLAG_DEFAULTS: dict[str, Any] = {"kv_lora_rank": 32, "qk_head_dim": 128, "qk_pos_emb_head_dim": 64,
                                     "v_head_dim": 128}
# YaRN's scalars: Megatron's flag defaults (--rotary-scaling-factor, --mscale, --mscale-all-dim) and
# MLATransformerConfig's (the original context and the betas, the --yarn-* flags' defaults too).
YARN_FLAG_DEFAULTS: dict[str, Any] = {"rotary_scaling_factor": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                                      "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}
_FLAG = {"original_max_position_embeddings": "--yarn-original-max-position-embeddings",
         "beta_fast": "--yarn-beta-fast", "beta_slow": "--yarn-beta-slow"}


def _flag(name: str) -> str:
    return _FLAG.get(name, "--" + name.replace("_", "-"))


def _mla(ns: argparse.Namespace, notes: list[str], checkpoint: dict[str, Any]) -> dict[str, Any]:
    """The MLA fields, refusing the flags Megatron refuses beside it; ``{}`` without --multi-latent-attention,
    where an MLA size flag other than its default is refused (Megatron would leave it unused) unless the
    ``checkpoint`` the run starts from has multi-latent attention (its fields are compared with them later)."""
    if not ns.multi_latent_attention:
        if not checkpoint.get("multi_latent_attention"):
            _refuse_unused(ns, {"q_lora_rank": 0, **MLA_FLAG_DEFAULTS}, "sizes multi-latent attention: add "
                           "--multi-latent-attention, or")
        return {}
    # Megatron's validate_args asserts "Group query attention is mutually exclusive with multi latent attention".
    if ns.group_query_attention:
        raise ConfigError("--group-query-attention with --multi-latent-attention: the two are exclusive (as in "
                          "Megatron, which asserts it); drop --group-query-attention")
    # Megatron builds MLA's query and key/value latent norms (q_layernorm, kv_layernorm) only with --qk-layernorm,
    # else identities; DeepSeek's MLA has them and megazero's always builds them, so the flag must be there.
    if not ns.qk_layernorm:
        raise ConfigError("--multi-latent-attention without --qk-layernorm: Megatron then builds the attention "
                          "without the norms of its query and key/value latents, which megazero's multi-latent "
                          "attention (DeepSeek's) always has; add --qk-layernorm, as Megatron's DeepSeek-V3 and "
                          "Moonlight scripts do")
    # Megatron passes num_query_groups only with --group-query-attention (refused above), and MLA sizes its
    # heads by --qk-head-dim/--qk-pos-emb-head-dim/--v-head-dim: both flags are accepted and have no effect.
    unused = [f"--num-query-groups {ns.num_query_groups}" if ns.num_query_groups is not None else "",
              f"--kv-channels {ns.kv_channels}" if ns.kv_channels is not None else ""]
    if any(unused):
        notes.append(f"{' and '.join(u for u in unused if u)}: no effect under --multi-latent-attention (as in "
                     "Megatron; its heads are --qk-head-dim + --qk-pos-emb-head-dim wide, values --v-head-dim)")
    if ns.q_lora_rank is not None and ns.q_lora_rank < 0:
        raise ConfigError(f"--q-lora-rank must be >= 1 (the query latent's rank), or 0 or not given for no query "
                          f"latent; got {ns.q_lora_rank}")
    kw: dict[str, Any] = {"multi_latent_attention": True, "num_query_groups": None,
                          # the latents' norms come with multi-latent attention; qk_layernorm is the per-head
                          # query/key norm of attention without latents
                          "qk_layernorm": False,
                          "q_lora_rank": ns.q_lora_rank or None}  # 0: no query latent, as not given
    for name, value in MLA_FLAG_DEFAULTS.items():
        kw[name] = default(getattr(ns, name), value)
    return kw


def _rope(ns: argparse.Namespace, mla: bool) -> dict[str, Any]:
    """rope_type and, under YaRN, its scalars (Megatron's flag defaults where a flag is not given)."""
    by_position = ns.position_embedding_type == "yarn"
    if ns.rope_type == "yarn" and not mla:
        raise ConfigError("--rope-type yarn without --multi-latent-attention: Megatron asserts that attention "
                          "without latents takes --rope-type rope only; YaRN for it is --position-embedding-type yarn")
    if by_position and ns.rope_type == "rope":
        raise ConfigError("--position-embedding-type yarn contradicts --rope-type rope; drop one of them")
    yarn = by_position or ns.rope_type == "yarn" or (mla and ns.rope_type is None)
    if (by_position or ns.rope_type == "yarn") and ns.rotary_scaling_factor is None:
        asked = "--position-embedding-type yarn" if by_position else "--rope-type yarn"
        raise ConfigError(f"{asked} without --rotary-scaling-factor: YaRN extends the context by that factor; give "
                          "it (DeepSeek-V3: 40; 1 is plain RoPE)")
    kw: dict[str, Any] = {}
    if by_position or ns.rope_type is not None:
        kw["rope_type"] = "yarn" if by_position else ns.rope_type
    if yarn:
        kw.update({name: default(getattr(ns, name), value) for name, value in YARN_FLAG_DEFAULTS.items()})
        if ns.yarn_correction_range_round_to_int is False:
            kw["yarn_correction_range_round_to_int"] = False
        return kw
    if ns.yarn_correction_range_round_to_int is False:
        raise ConfigError("--no-yarn-correction-range-round-to-int needs YaRN (--position-embedding-type yarn, or "
                          "--multi-latent-attention); drop it")
    _refuse_unused(ns, YARN_FLAG_DEFAULTS, "needs YaRN (--multi-latent-attention, whose RoPE is YaRN unless "
                                           "--rope-type rope, or --position-embedding-type yarn);")
    return kw


def _refuse_unused(ns: argparse.Namespace, defaults: dict[str, Any], why: str) -> None:
    """Refuse the flags of ``defaults`` given with another value where they have no effect (``why``: what they
    need, the sentence ending in "drop it"); a flag given its default asks for what happens anyway."""
    typed = [f"{_flag(n)} {getattr(ns, n):g}" for n, v in defaults.items()
             if getattr(ns, n) is not None and not same_value(getattr(ns, n), v)]
    if typed:
        raise ConfigError(f"{', '.join(typed)} {why} drop {'them' if len(typed) > 1 else 'it'}")


def _mtp(ns: argparse.Namespace, position: str, checkpoint: dict[str, Any]) -> dict[str, Any]:
    layers = default(ns.mtp_num_layers, checkpoint.get("mtp_num_layers") or 0)
    if not layers:
        _refuse_unused(ns, {"mtp_loss_scaling_factor": 0.1}, "weighs multi-token prediction, which needs "
                                                              "--mtp-num-layers D;")
        return {}
    if position == "learned":  # Megatron's validate_args asserts rope or none
        raise ConfigError(f"--mtp-num-layers {layers} with learned absolute position embeddings: multi-token "
                          "prediction (as in Megatron) needs --position-embedding-type rope or none")
    return {"mtp_num_layers": layers, "mtp_loss_scaling_factor": default(ns.mtp_loss_scaling_factor, 0.1)}


def mla_kwargs(ns: argparse.Namespace, position: str, notes: list[str],
               checkpoint: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    """GPTConfig keyword arguments of the multi-latent attention, RoPE-scaling and multi-token prediction flags;
    ``position``: the resolved position_embedding_type; ``checkpoint``: the saved model fields of the checkpoint
    the run starts from, whose multi-latent attention and prediction depth the flags then apply to. Raises
    ConfigError naming the flag and the fix."""
    checkpoint = checkpoint or {}
    kw = _mla(ns, notes, checkpoint)
    kw.update(_rope(ns, bool(kw) or bool(checkpoint.get("multi_latent_attention"))))
    kw.update(_mtp(ns, position, checkpoint))
    return kw


def given_mla_fields(ns: argparse.Namespace) -> dict[str, tuple[str, Any]]:
    """GPTConfig field -> (the flag as typed, its value) for these flags as the command line gave them (for the
    comparison with a checkpoint's model)."""
    given: dict[str, tuple[str, Any]] = {}
    if ns.multi_latent_attention:
        given["multi_latent_attention"] = ("--multi-latent-attention", True)
        given["qk_layernorm"] = ("--qk-layernorm", False)  # under MLA the field stays False (see _mla)
    for name in ("q_lora_rank", *MLA_FLAG_DEFAULTS, *YARN_FLAG_DEFAULTS, "rope_type", "mtp_num_layers",
                 "mtp_loss_scaling_factor"):
        value = getattr(ns, name)
        if value is not None:
            value = (value or None) if name == "q_lora_rank" else value
            given[name] = (f"{_flag(name)} {getattr(ns, name)}", value)
    return given
