"""Model: GPTConfig from the model flags, --model-preset and (--use-checkpoint-args) the checkpoint."""

from __future__ import annotations

import argparse
import dataclasses
from typing import Any, Optional

import torch

from megazero.config.resolve.common import default
from megazero.config.resolve.hybrid import check_hybrid_model, hybrid_kwargs
from megazero.config.resolve.mla import given_mla_fields, mla_kwargs
from megazero.config.resolve.resume import (
    CHECKPOINT_FILL_FIELDS,
    CHECKPOINT_LEARNED_FIELDS,
    CHECKPOINT_MODEL_FIELDS,
    CHECKPOINT_TRAINING_FIELDS,
    checkpoint_args_source,
    checkpoint_model,
    checkpoint_model_kwargs,
    checkpoint_training_kwargs,
    flags_give_the_shape,
    keep_saved_vocab_padding,
)
from megazero.config.train_config import ConfigError, DataConfig, ParallelConfig, PrecisionConfig
from megazero.model.config import PRESETS, GPTConfig

GPT2_VOCAB_SIZE = 50257  # GPT-2 BPE (50,000 merges + 256 bytes + <|endoftext|>)


def _model_vocab_size(ns: argparse.Namespace, data: DataConfig, preset: dict[str, Any], check_files: bool) -> int:
    """The model's (unpadded) vocabulary, Megatron's way: the tokenizer decides.

    NullTokenizer: --vocab-size + 1 (its EOD id). Other tokenizers: read from the
    tokenizer files (or --vocab-size, an explicit override that must not be smaller).
    No tokenizer (mock data): --vocab-size, else the preset's.
    """
    t = data.tokenizer_type
    if t == "NullTokenizer":
        return data.vocab_size + 1
    if t is not None and ns.vocab_size is None:
        if check_files:
            from megazero.data import build_tokenizer  # lazy: tokenizer libraries

            try:
                return build_tokenizer(t, **data.tokenizer_kwargs()).vocab_size
            except (OSError, ValueError, RuntimeError) as e:
                raise ConfigError(f"could not load the {t} to read its vocabulary size: {e}") from None
        if t == "GPT2BPETokenizer":
            return GPT2_VOCAB_SIZE
    if ns.vocab_size is not None:
        if ns.vocab_size < 1:
            raise ConfigError(f"--vocab-size must be >= 1, got {ns.vocab_size}")
        return ns.vocab_size
    if "vocab_size" in preset:
        return preset["vocab_size"]
    raise ConfigError("cannot tell the vocabulary size: pass --vocab-size (or --tokenizer-type with its files, "
                      "or a --model-preset)")


# Megatron model options that map to GPTConfig fields:
# (GPTConfig field, flag, value that means "off"). A flag is passed only when set; a build whose
# GPTConfig lacks the field refuses the flag instead of dropping it.
MODEL_FIELD_FLAGS: tuple[tuple[str, str, Any], ...] = (
    ("rotary_percent", "--rotary-percent", 1.0),
    ("kv_channels", "--kv-channels", None),
    ("qk_layernorm", "--qk-layernorm", False),
    ("apply_layernorm_1p", "--apply-layernorm-1p", False),
    ("init_method", "--init-method-xavier-uniform", "normal"),
    ("fp32_residual_connection", "--fp32-residual-connection", False),
    ("apply_query_key_layer_scaling", "--apply-query-key-layer-scaling", False),
    ("window_size", "--window-size", None),
    ("window_attn_skip_freq", "--window-attn-skip-freq", None),
    ("softmax_type", "--softmax-type", "vanilla"),
)


def model_field_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """GPTConfig keyword arguments of the newer model flags that the command line set."""
    kw: dict[str, Any] = {}
    if ns.rotary_percent is not None:
        kw["rotary_percent"] = ns.rotary_percent
    if ns.kv_channels is not None:
        kw["kv_channels"] = ns.kv_channels
    for attr in ("qk_layernorm", "apply_layernorm_1p", "fp32_residual_connection", "add_qkv_bias"):
        if getattr(ns, attr):
            kw[attr] = True
    if ns.init_method_xavier_uniform:
        kw["init_method"] = "xavier_uniform"
    if ns.apply_query_key_layer_scaling is not None:
        kw["apply_query_key_layer_scaling"] = bool(ns.apply_query_key_layer_scaling)
    for attr in ("window_size", "window_attn_skip_freq", "softmax_type"):
        if getattr(ns, attr) is not None:
            kw[attr] = getattr(ns, attr)
    return kw


def activation_kwargs(ns: argparse.Namespace, preset: dict[str, Any]) -> dict[str, Any]:
    """GPTConfig's ``activation`` (--swiglu, --squared-relu, --quick-geglu, else the preset's or checkpoint's,
    else gelu) and the gated unit's --glu-linear-offset and --activation-func-clamp-value where given. Refuses
    two activations, and the offset or the clamp without a gated unit (Megatron would ignore them)."""
    chosen = [f for f, on in (("--swiglu", ns.swiglu), ("--squared-relu", ns.squared_relu),
                              ("--quick-geglu", ns.quick_geglu)) if on]
    if len(chosen) > 1:
        raise ConfigError(f"{' and '.join(chosen)} are different MLP activations; pass one")
    activation = ("swiglu" if ns.swiglu else "squared_relu" if ns.squared_relu else "quick_geglu" if ns.quick_geglu
                  else preset.get("activation", "gelu"))
    kw: dict[str, Any] = {"activation": activation}
    offset, clamp = ns.glu_linear_offset, ns.activation_func_clamp_value
    given = [f"{flag} {value:g}" for flag, value, off in (("--glu-linear-offset", offset, 0.0),
                                                           ("--activation-func-clamp-value", clamp, None))
             if value is not None and value != off]
    if given and activation not in ("swiglu", "quick_geglu"):
        verb, them = ("apply", "them") if len(given) > 1 else ("applies", "it")
        raise ConfigError(f"{' and '.join(given)} {verb} to a gated MLP, not to {activation}: add --quick-geglu "
                          f"(gpt-oss's) or --swiglu, or drop {them}")
    if clamp is not None and not clamp > 0:
        raise ConfigError(f"--activation-func-clamp-value {clamp:g} must be > 0 (x1 is clamped to at most the value, "
                          "x2 to within +- the value)")
    if offset is not None:
        kw["glu_linear_offset"] = offset
    if clamp is not None:
        kw["activation_func_clamp_value"] = clamp
    return kw


# Megatron-core's RotaryEmbedding._apply_scaling under --use-rope-scaling: Llama 3.1's values but the factor.
MEGATRON_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_scaling_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    """GPTConfig keyword arguments of --use-rope-scaling (Llama 3's RoPE scaling, factor --rope-scaling-factor);
    none without it. Refuses the factor alone and the flag beside another RoPE scaling."""
    if not ns.use_rope_scaling:
        if ns.rope_scaling_factor is not None and ns.rope_scaling_factor != 8.0:
            raise ConfigError(f"--rope-scaling-factor {ns.rope_scaling_factor:g} without --use-rope-scaling has no "
                              "effect; add --use-rope-scaling or drop it")
        return {}
    if ns.position_embedding_type == "yarn" or ns.multi_latent_attention or ns.rope_type not in (None, "rope"):
        raise ConfigError("--use-rope-scaling (Llama 3's RoPE scaling) beside --position-embedding-type yarn, "
                          "--multi-latent-attention or --rope-type: one RoPE scaling per model; drop one")
    return dict(rope_type="llama3", rotary_scaling_factor=default(ns.rope_scaling_factor, 8.0),
                **MEGATRON_ROPE_SCALING)


def moe_kwargs(ns: argparse.Namespace, experts: Any = None) -> dict[str, Any]:
    """GPTConfig keyword arguments of the mixture-of-experts flags the command line set, for a model of
    --num-experts experts, else of ``experts`` (the checkpoint's, which then sets num_experts itself); none for
    a dense model."""
    if ns.num_experts and len(ns.num_experts) != 1:
        raise ConfigError(f"--num-experts {' '.join(map(str, ns.num_experts))}: one number of experts for every MoE "
                          "layer (a per-layer list is not available); give one value")
    if not ns.num_experts and not experts:
        return {}
    kw: dict[str, Any] = {"num_experts": ns.num_experts[0]} if ns.num_experts else {}
    if ns.moe_pad_expert_input_to_capacity and ns.moe_expert_capacity_factor is None:
        raise ConfigError("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor (the capacity each "
                          "expert's rows are padded to); add it, or drop the padding (dropless)")
    for name in ("moe_router_topk", "moe_ffn_hidden_size", "moe_layer_freq", "moe_router_load_balancing_type",
                 "moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_expert_capacity_factor", "moe_token_drop_policy",
                 "moe_router_score_function", "moe_router_num_groups", "moe_router_group_topk",
                 "moe_router_topk_scaling_factor", "moe_router_dtype", "moe_router_bias_update_rate"):
        if getattr(ns, name) is not None:
            kw[name] = getattr(ns, name)
    for name in ("moe_router_pre_softmax", "moe_shared_expert_gate", "moe_router_enable_expert_bias",
                 "moe_grouped_gemm", "moe_pad_expert_input_to_capacity"):
        if getattr(ns, name):
            kw[name] = True
    if ns.moe_shared_expert_intermediate_size is not None:
        kw["moe_shared_expert_intermediate_size"] = ns.moe_shared_expert_intermediate_size
    for name in ("moe_min_capacity", "moe_eval_capacity_factor"):  # set by DeepSpeed-MoE's flags only
        if getattr(ns, name, None) is not None:
            kw[name] = getattr(ns, name)
    return kw


def build_gpt_config(kw: dict[str, Any]) -> GPTConfig:
    """GPTConfig(**kw), refusing (not dropping) options this build's GPTConfig has no field for."""
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    flag_of = {name: flag_name for name, flag_name, _ in MODEL_FIELD_FLAGS}
    off = {name: value for name, _, value in MODEL_FIELD_FLAGS}
    for name in [k for k in kw if k not in fields]:
        if name in off and kw[name] == off[name]:
            kw.pop(name)  # asks for what this model does anyway
        else:
            raise ConfigError(f"{flag_of.get(name, name)} is not supported by this build's model "
                              f"(GPTConfig has no field '{name}')")
    return GPTConfig(**kw)


def _from_checkpoint(ns: argparse.Namespace, check_files: bool,
                     notes: list[str]) -> tuple[str, dict[str, Any], Optional[GPTConfig]]:
    """``(where, the saved fields the run takes, the checkpoint's whole model)`` of the checkpoint the run starts
    from; ``("", {}, None)`` for a fresh start, or where the flags size the model and the checkpoint cannot be
    read before the run (its load then names what is wrong with it)."""
    source = checkpoint_args_source(ns, check_files)
    if source is None:
        return "", {}, None
    try:
        where, saved = checkpoint_model(ns, source)
        try:
            origin = GPTConfig.from_dict(saved)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"{where} does not hold a model configuration this build reads: {e}") from None
    except ConfigError:
        if flags_give_the_shape(ns) and not ns.use_checkpoint_args:
            return "", {}, None
        raise
    notes.append(f"model from the checkpoint {where}: every model setting no flag gives")
    taken = CHECKPOINT_MODEL_FIELDS + CHECKPOINT_LEARNED_FIELDS + CHECKPOINT_TRAINING_FIELDS + CHECKPOINT_FILL_FIELDS
    return where, {k: v for k, v in saved.items() if k in taken}, origin


def given_model_fields(ns: argparse.Namespace, pos: Any, eps_field: str, data: DataConfig,
                       experts: Any = None) -> dict[str, tuple[str, Any]]:
    """GPTConfig field -> (the flag as typed, its value) for each model flag the command line set; ``pos``:
    the position embedding type the flags asked for (None: none); ``experts``: the checkpoint's number of
    experts, whose mixture-of-experts flags count without --num-experts."""
    given: dict[str, tuple[str, Any]] = {}
    for attr in ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "num_query_groups",
                 "max_position_embeddings", "rotary_base", "normalization", "hidden_dropout", "attention_dropout",
                 "init_method_std", "label_smoothing"):
        if getattr(ns, attr) is not None:
            given[attr] = (f"--{attr.replace('_', '-')} {getattr(ns, attr)}", getattr(ns, attr))
    if pos is not None:
        given["position_embedding_type"] = (f"--position-embedding-type {pos}", pos)
    if ns.norm_epsilon is not None:
        given[eps_field] = (f"--norm-epsilon {ns.norm_epsilon}", ns.norm_epsilon)
    if ns.vocab_size is not None and data.tokenizer_type != "NullTokenizer":  # NullTokenizer's is its own
        given["vocab_size"] = (f"--vocab-size {ns.vocab_size}", ns.vocab_size)
    for on, field, flag_name, value in ((ns.swiglu, "activation", "--swiglu", "swiglu"),
                                        (ns.squared_relu, "activation", "--squared-relu", "squared_relu"),
                                        (ns.quick_geglu, "activation", "--quick-geglu", "quick_geglu"),
                                        (ns.disable_bias_linear, "add_bias_linear", "--disable-bias-linear", False),
                                        (ns.untie_embeddings_and_output_weights, "tie_embeddings",
                                         "--untie-embeddings-and-output-weights", False)):
        if on:
            given[field] = (flag_name, value)
    for name in ("glu_linear_offset", "activation_func_clamp_value"):
        if getattr(ns, name) is not None:
            given[name] = (f"--{name.replace('_', '-')} {getattr(ns, name):g}", getattr(ns, name))
    flag_of = {name: flag_name for name, flag_name, _ in MODEL_FIELD_FLAGS}
    for name, value in {**model_field_kwargs(ns), **moe_kwargs(ns, experts), **hybrid_kwargs(ns)}.items():
        flag_name = flag_of.get(name, f"--{name.replace('_', '-')}")
        given[name] = (flag_name if isinstance(value, bool) else f"{flag_name} {value}", value)
    if ns.hybrid_layer_pattern is not None:  # the pattern gave --num-layers: name what was typed
        given["num_layers"] = (f"--hybrid-layer-pattern {ns.hybrid_layer_pattern} ({ns.num_layers} layers)",
                               ns.num_layers)
    given.update(given_mla_fields(ns))
    for name, value in rope_scaling_kwargs(ns).items():
        typed = f"--rope-scaling-factor {value:g}" if name == "rotary_scaling_factor" else "--use-rope-scaling"
        given[name] = (typed, value)
    return given


_ATTENTION_BACKENDS = {"auto": "auto", "flash": "flash", "fused": "sdpa", "unfused": "math", "local": "math"}


def resolve_model(ns: argparse.Namespace, par: ParallelConfig, prec: PrecisionConfig, data: DataConfig,
                   check_files: bool, notes: list[str]) -> GPTConfig:
    preset: dict[str, Any] = {}
    if ns.model_preset is not None:
        key = ns.model_preset.lower()
        key = key if key in PRESETS else "gpt-" + key
        if key not in PRESETS:
            raise ConfigError(f"unknown --model-preset {ns.model_preset!r}; choose one of {', '.join(PRESETS)}")
        preset = dict(PRESETS[key])
    where, saved, origin = _from_checkpoint(ns, check_files, notes)
    preset.update(saved)
    if ns.num_key_value_heads is not None:
        if ns.num_query_groups is not None and ns.num_query_groups != ns.num_key_value_heads:
            raise ConfigError(f"--num-key-value-heads {ns.num_key_value_heads} disagrees with --num-query-groups "
                              f"{ns.num_query_groups}; they are the same setting")
        ns.num_query_groups = ns.num_key_value_heads
    kw: dict[str, Any] = {}
    for attr in ("num_layers", "hidden_size", "num_attention_heads", "seq_length"):
        kw[attr] = default(getattr(ns, attr), preset.get(attr))
    missing = [f"--{a.replace('_', '-')}" for a, v in kw.items() if v is None]
    if missing:
        raise ConfigError(f"missing {', '.join(missing)}: give the model's shape, a --model-preset, or "
                          "--load/--pretrained-checkpoint with a checkpoint to take the model from")
    kw["num_query_groups"] = default(ns.num_query_groups, preset.get("num_query_groups"))
    kw["ffn_hidden_size"] = default(ns.ffn_hidden_size, preset.get("ffn_hidden_size"))
    # yarn: RoPE whose rope_type is yarn (mla_kwargs)
    pos = {"learned_absolute": "learned", "yarn": "rope"}.get(ns.position_embedding_type, ns.position_embedding_type)
    for alias, flag_name, value in ((ns.use_rotary_position_embeddings, "--use-rotary-position-embeddings", "rope"),
                                    (ns.no_position_embedding, "--no-position-embedding", "none")):
        if alias and value == "none" and pos == "rope":  # no learned table: Megatron's Mixtral script gives both
            continue
        if alias:
            if pos not in (None, value):
                raise ConfigError(f"{flag_name} contradicts --position-embedding-type {ns.position_embedding_type}")
            pos = value
    kw["position_embedding_type"] = default(pos, preset.get("position_embedding_type", "learned"))
    max_pos = default(ns.max_position_embeddings, preset.get("max_position_embeddings", kw["seq_length"]))
    if kw["position_embedding_type"] != "learned" and ns.max_position_embeddings is None:
        max_pos = max(max_pos, kw["seq_length"])  # no position table to outgrow
    kw["max_position_embeddings"] = max_pos
    if kw["position_embedding_type"] == "learned" and kw["seq_length"] > max_pos:
        raise ConfigError(f"--seq-length {kw['seq_length']} exceeds --max-position-embeddings {max_pos}; "
                          f"raise --max-position-embeddings to at least {kw['seq_length']}")
    granularity = ns.recompute_granularity
    if ns.checkpoint_activations or ns.recompute_activations:
        alias = "full" if ns.checkpoint_activations else "selective"
        if granularity not in (None, alias) or (ns.checkpoint_activations and ns.recompute_activations):
            raise ConfigError("conflicting recompute flags: --checkpoint-activations means --recompute-granularity "
                              "full and --recompute-activations means selective; pass one")
        granularity = alias
    if ns.checkpoint_num_layers is not None:
        if ns.recompute_num_layers not in (None, ns.checkpoint_num_layers):
            raise ConfigError(f"--checkpoint-num-layers {ns.checkpoint_num_layers} disagrees with "
                              f"--recompute-num-layers {ns.recompute_num_layers}; they are the same setting")
        ns.recompute_num_layers = ns.checkpoint_num_layers
    if granularity != "full" and ns.recompute_method is not None:
        raise ConfigError("--recompute-method needs --recompute-granularity full")
    if granularity != "full" and ns.recompute_num_layers is not None and not ns.checkpoint_num_layers:
        raise ConfigError("--recompute-num-layers needs --recompute-granularity full")
    _check_recompute_modules(ns.recompute_modules, granularity)
    backend = _ATTENTION_BACKENDS[default(ns.attention_backend, "auto")]
    if ns.use_flash_attn:
        if backend not in ("auto", "flash"):
            raise ConfigError(f"--use-flash-attn contradicts --attention-backend {ns.attention_backend}")
        backend = "flash"
    kw.update(activation_kwargs(ns, preset))
    kw.update(
        vocab_size=saved["vocab_size"] if "vocab_size" in saved else _model_vocab_size(ns, data, preset, check_files),
        normalization=default(ns.normalization, preset.get("normalization", "layernorm")),
        add_bias_linear=not ns.disable_bias_linear and preset.get("add_bias_linear", True),
        tie_embeddings=not ns.untie_embeddings_and_output_weights and preset.get("tie_embeddings", True),
        sequence_parallel=par.sequence_parallel,
        recompute_granularity=granularity,
        recompute_method=default(ns.recompute_method, "uniform"),
        recompute_num_layers=default(ns.recompute_num_layers, 1),
        attention_backend=backend,
        params_dtype=prec.torch_dtype,  # as Megatron: compute weights in the training dtype
    )
    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    eps_field = "norm_epsilon" if "norm_epsilon" in fields else "layernorm_epsilon"
    for attr, ns_attr in (("rotary_base", "rotary_base"), (eps_field, "norm_epsilon"),
                          ("init_method_std", "init_method_std"), ("hidden_dropout", "hidden_dropout"),
                          ("attention_dropout", "attention_dropout"), ("label_smoothing", "label_smoothing"),
                          ("make_vocab_size_divisible_by", "make_vocab_size_divisible_by")):
        value = default(getattr(ns, ns_attr), preset.get(attr))
        if value is not None:
            kw[attr] = value
    kw.update(model_field_kwargs(ns))
    kw.update(moe_kwargs(ns, saved.get("num_experts")))
    kw.update(hybrid_kwargs(ns))
    kw.update(mla_kwargs(ns, kw["position_embedding_type"], notes, saved))
    kw.update(rope_scaling_kwargs(ns))
    for key in ("kv_channels", eps_field):
        if key in preset and key not in kw and key in fields:
            kw[key] = preset[key]
    if saved:
        given = given_model_fields(ns, pos, eps_field, data, saved.get("num_experts"))
        kw.update(checkpoint_model_kwargs(saved, given, where))
        kw.update(checkpoint_training_kwargs(saved, given, where, notes))
        if ns.hybrid_layer_pattern is not None:  # the same layers, cut into pipeline stages the run's way
            kw["hybrid_layer_pattern"] = ns.hybrid_layer_pattern
    check_hybrid_model(ns, kw.get("hybrid_layer_pattern"))
    # Megatron's masks at every layout (the fused kernels run); position-keyed masks, the same at every
    # layout, only when asked: their attention dropout runs the explicit formula in tiles.
    kw["dropout_rng"] = ns.dropout_rng or "stream"
    kw["vocab_padding_tp"] = par.tp  # Megatron pads to make_vocab_size_divisible_by x tp
    if check_files:
        keep_saved_vocab_padding(ns, kw, par.tp, notes)
    if backend == "flash" and check_files:  # a launch on the local machine, not a plan for another
        _check_flash_attn(prec)
    config = build_gpt_config(kw)
    try:
        config = config.validate(par.tp)
    except ValueError as e:
        raise ConfigError(f"model config: {e}") from None
    note = hf_export_note(config, origin)
    if note:
        notes.append(note)
    return config


def _check_recompute_modules(modules: Any, granularity: Any) -> None:
    """--recompute-modules: megazero's selective recompute is Megatron's default module, core attention."""
    if modules is None:
        return
    if granularity != "selective":
        raise ConfigError(f"--recompute-modules {' '.join(modules)} needs --recompute-granularity selective")
    other = [m for m in modules if m != "core_attn"]
    if other:
        raise ConfigError(f"--recompute-modules {' '.join(other)}: megazero's selective recompute recomputes core "
                          "attention only (core_attn, Megatron's default); recompute whole layers with "
                          "--recompute-granularity full, or give --recompute-modules core_attn")


def _check_flash_attn(prec: PrecisionConfig) -> None:
    """Refuse flash attention up front where it cannot run (it would fail at the first forward)."""
    from megazero.model.attention.core import flash_attn_available

    problems = []
    if not torch.cuda.is_available():
        problems.append("no CUDA device is visible")
    if not flash_attn_available():
        problems.append("the flash-attn package is not installed (pip install flash-attn --no-build-isolation)")
    if prec.dtype == "fp32":
        problems.append("flash attention needs --bf16 or --fp16")
    if problems:
        raise ConfigError("--use-flash-attn cannot run here: " + "; ".join(problems)
                          + "; drop the flag to use PyTorch's scaled_dot_product_attention")


def hf_export_note(model: GPTConfig, origin: Optional[GPTConfig]) -> Optional[str]:
    """A start-up warning when the run's ``model`` cannot be exported to the Hugging Face family it came from
    (tools/convert_to_hf.py would refuse the trained checkpoint): the family the checkpoint it starts from
    (``origin``) converts to; for a run from flags, DeepSeek-V3 for multi-latent attention, the one family that
    has it. None when it exports there, or came from no such family."""
    from megazero.model.interop.hf import HF_ARCHITECTURES, hf_architecture

    if origin is not None:
        try:
            family = hf_architecture(origin)
        except ValueError:
            return None  # the checkpoint is no Hugging Face model either
    elif model.multi_latent_attention:
        family = "deepseek_v3"
    else:
        return None
    try:
        got = hf_architecture(model)
        if got == family:
            return None
        why = f"it is a {HF_ARCHITECTURES[got]} now"
    except ValueError as e:
        why = str(e).rstrip(".")
    came = "the checkpoint's family" if origin is not None else "the family of multi-latent attention"
    return (f"warning: tools/convert_to_hf.py cannot export this run's model to {HF_ARCHITECTURES[family]} ({came}): "
            f"{why}")
