"""Megatron-style command line -> validated ``TrainConfig``.

Flag names follow Megatron-LM (and Megatron-DeepSpeed for ``--zero-stage``,
``--deepspeed_config``, ``--no-pipeline-parallel``), so existing launch scripts
mostly run unchanged. Everything is checked here, *before* ``torch.distributed``
starts: a bad batch split or a missing file found after the first collective
would hang or crash every rank at once, far from its cause.

Precedence of a value: command line > --deepspeed-config JSON > --model-preset >
built-in default. A value given on the command line *and* in the JSON must agree.

    cfg = parse_args_or_exit(None, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    tokenizer = megazero.data.build_tokenizer(cfg.data.tokenizer_type, **cfg.data.tokenizer_kwargs())
    check_vocab(cfg, tokenizer.vocab_size)
    engine = megazero.zero.initialize(model, cfg.zero_config(), mpu=mpu)
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys
import time
from collections import Counter
from typing import NoReturn, Optional, Sequence

from megazero.config.flag_names import with_flags
from megazero.config.flags import HELP_EPILOG, add_to_parser, refusals
from megazero.config.resolve.common import default
from megazero.config.resolve.data import (
    DEFAULT_TOKENIZER,
    TOKENIZER_TYPES,
    missing_data_flags,
    read_data_args_files,
    resolve_data,
)
from megazero.config.resolve.deepspeed_json import load_deepspeed_json, merge_deepspeed
from megazero.config.resolve.deepspeed_moe import balancing_notes, merge_deepspeed_moe
from megazero.config.resolve.hybrid import check_linear_context_parallel, resolve_hybrid_pattern, spec_refusals
from megazero.config.resolve.logs import resolve_logging
from megazero.config.resolve.model import (
    GPT2_VOCAB_SIZE,
    MODEL_FIELD_FLAGS,
    build_gpt_config,
    model_field_kwargs,
    resolve_model,
)
from megazero.config.resolve.optim import resolve_optim
from megazero.config.resolve.parallel import (
    check_local_rank,
    pipeline_plan_line,
    resolve_context_parallel,
    resolve_expert_parallel,
    resolve_parallel,
    resolve_pipeline,
)
from megazero.config.resolve.planning import PLANNING_NOTE, fill_for_planning
from megazero.config.resolve.precision import resolve_precision
from megazero.config.resolve.resume import check_pretrained, checkpoint_tokenizer_flags, resolve_checkpoint
from megazero.config.resolve.schedule import resolve_schedule
from megazero.config.train_config import (  # noqa: F401  (the config classes are re-exported)
    CheckpointConfig,
    ConfigError,
    DataConfig,
    GenerateConfig,
    LoggingConfig,
    OptimConfig,
    ParallelConfig,
    PrecisionConfig,
    ScheduleConfig,
    TrainConfig,
    rampup_global_batch_size,
)
from megazero.model.config import PRESETS, GPTConfig  # noqa: F401  (re-exported)
from megazero.utils.output import console, write_error_file
from megazero.zero.optimizers import component

__all__ = ["ConfigError", "build_parser", "parse_args", "parse_args_or_exit", "check_vocab", "describe",
           "pipeline_plan_line", "build_gpt_config", "model_field_kwargs", "MODEL_FIELD_FLAGS", "TOKENIZER_TYPES",
           "DEFAULT_TOKENIZER", "GPT2_VOCAB_SIZE"]

log = logging.getLogger(__name__)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of exiting, so callers (and tests) decide."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(f"{message}; run with --help for the list of flags")

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self.error(unknown_flags_message(extras, self))
        return ns


def unknown_flags_message(extras: Sequence[str], parser: argparse.ArgumentParser) -> str:
    """One clause for the words ``parser`` did not take: each unknown flag with the flags closest to it."""
    import difflib

    known = sorted(s for a in parser._actions if a.help != argparse.SUPPRESS for s in a.option_strings)
    flags = [w.split("=", 1)[0] for w in extras if w.startswith("-") and len(w) > 1]
    if not flags:
        return f"unexpected argument{'s' if len(extras) > 1 else ''} {' '.join(extras)}"
    parts = []
    for flag in flags:
        near = [k for k in known if k.startswith(flag) and k != flag][:3]
        near += [k for k in difflib.get_close_matches(flag, known, n=3, cutoff=0.6) if k not in near]
        parts.append(flag + (f" (did you mean {' or '.join(near[:3])}?)" if near else ""))
    return f"unknown flag{'s' if len(parts) > 1 else ''} " + ", ".join(parts)


def build_parser() -> argparse.ArgumentParser:
    """The flag set, built from the table in ``megazero.config.flags``. Defaults are None
    on purpose: "not given" must be told apart from "given as the default" to merge presets
    and the DeepSpeed JSON correctly, and to find refused flags."""
    p = _Parser(prog="pretrain_gpt.py", description="Pretrain a GPT with tensor parallelism and ZeRO. "
                "[honoured]: Megatron's meaning; [mapped]: met by the megazero mechanism named. "
                "(default: X) is the value in force when the flag is not given.",
                usage="%(prog)s [-h] [FLAG [VALUE ...] ...]", epilog=HELP_EPILOG, allow_abbrev=False)
    add_to_parser(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None, *,
               check_files: bool = True, planning: bool = False,
               parser: Optional[argparse.ArgumentParser] = None) -> TrainConfig:
    """Parse and validate a Megatron-style command line into a ``TrainConfig``.

    ``argv`` defaults to ``sys.argv[1:]``; ``world_size`` to ``$WORLD_SIZE`` (else 1).
    ``check_files=False`` skips the existence checks on data/tokenizer files (for
    planning a run on another machine, e.g. the launch script's dry run). Raises
    ``ConfigError`` naming the offending flags and numbers. ``planning=True`` (the planning
    tools) gives the training-only flags a plan does not need (learning rate, run length, data)
    placeholder values when absent (:func:`~megazero.config.resolve.planning.fill_for_planning`),
    and validates the rest as here. ``parser``: a planning tool's, pretrain_gpt.py's flags and its own.
    """
    try:
        return _parse_args(argv, world_size, check_files, planning, parser)
    except ConfigError as e:  # the model's and the pipeline's messages name their fields: name the flags
        raise ConfigError(with_flags(str(e))) from None


def _parse_args(argv: Optional[Sequence[str]], world_size: Optional[int], check_files: bool, planning: bool,
                parser: Optional[argparse.ArgumentParser]) -> TrainConfig:
    argv = sys.argv[1:] if argv is None else list(argv)
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    ns = (parser or build_parser()).parse_args(argv)
    refused = refusals(ns) + spec_refusals(ns)
    if refused:
        raise ConfigError("refused before any process starts:\n  " + "\n  ".join(refused))
    check_local_rank(ns)
    notes: list[str] = []
    ds = load_deepspeed_json(ns.deepspeed_config)
    if ds is not None:
        merge_deepspeed(ns, ds, notes)
    merge_deepspeed_moe(ns, notes)
    read_data_args_files(ns, check_files)
    if planning:
        notes += fill_for_planning(ns)
    resolve_hybrid_pattern(ns, notes)  # the pattern gives --num-layers
    missing = missing_required(ns)
    if missing:
        raise ConfigError("missing required flags: " + "; ".join(missing))
    parallel = resolve_parallel(ns, world_size, notes, check_files)
    parallel.local_rank = ns.local_rank
    precision = resolve_precision(ns, ds, ns.deepspeed_config, notes)
    optim = resolve_optim(ns, ds)
    check_pretrained(ns, check_files)  # before anything reads the checkpoint's config
    checkpoint_tokenizer_flags(ns, notes)  # from a checkpoint, no tokenizer flags: the tokenizer it recorded
    data = resolve_data(ns, check_files)
    model = resolve_model(ns, parallel, precision, data, check_files, notes)
    resolve_expert_parallel(parallel, model)
    check_linear_context_parallel(model, parallel)
    notes += balancing_notes(ns, model)
    if optim.qk_clip or optim.log_max_attention_logit:
        if parallel.cp > 1:
            raise ConfigError("--qk-clip and --log-max-attention-logit take each head's largest logit over the whole "
                              "sequence, which a context-parallel rank does not see: use --context-parallel-size 1")
        model = dataclasses.replace(model, track_max_attention_logit=True)
    schedule = resolve_schedule(ns, parallel, ds, ns.deepspeed_config, model.seq_length)
    resolve_pipeline(ns, parallel, model, schedule)
    resolve_context_parallel(parallel, model, notes)
    checkpoint = resolve_checkpoint(ns, notes, check_files)
    logging_cfg = resolve_logging(ns, ds, notes, check_files)
    generate = GenerateConfig(prompt=ns.generate_prompt, tokens=default(ns.generate_tokens, GenerateConfig.tokens))
    if generate.tokens < 0:
        raise ConfigError(f"--generate-tokens must be >= 0, got {generate.tokens}")
    if generate.prompt is not None and parallel.pp > 1:
        raise ConfigError(f"--generate-prompt with --pp {parallel.pp}: sampling runs the whole model on each TP "
                          "group, which a pipeline stage does not hold; drop it and sample from the saved checkpoint "
                          "with tools/generate.py --load SAVE_DIR (any tp, pp = 1)")
    for note_flag, text in (("overlap_param_gather", "--overlap-param-gather: ZeRO-3 prefetches one unit ahead; "
                             "at stages 1/2 the post-step all-gather runs after the step"),):
        if getattr(ns, note_flag):
            notes.append(text)
    cfg = TrainConfig(
        model=model, parallel=parallel, precision=precision, optim=optim, schedule=schedule, data=data,
        checkpoint=checkpoint,
        logging=logging_cfg, generate=generate, seed=default(ns.seed, 1234), deepspeed_json=ds, notes=notes)
    _check_engine_config(cfg)
    return cfg


def missing_required(ns: argparse.Namespace) -> list[str]:
    """Every required flag the command line (with its DeepSpeed JSON merged) lacks, one entry each, so
    that one run names them all."""
    missing = []
    from_checkpoint = bool(ns.use_checkpoint_args or ns.load or ns.pretrained_checkpoint)  # it may hold the shape
    if ns.model_preset is None and not from_checkpoint:
        shape = [f"--{a.replace('_', '-')}" for a in ("num_layers", "hidden_size", "num_attention_heads",
                                                      "seq_length") if getattr(ns, a) is None]
        if shape:
            missing.append(", ".join(shape) + " (or a --model-preset such as gpt-125m)")
    if ns.micro_batch_size is None:
        missing.append("--micro-batch-size N (sequences per rank per forward pass)")
    if ns.lr is None:
        missing.append("--lr LR (the peak learning rate, e.g. 3e-4)")
    if ns.train_iters is None and ns.train_samples is None:
        missing.append("--train-iters N (or --train-samples N)")
    missing += missing_data_flags(ns, tokenizer=not from_checkpoint)
    return missing


def _check_engine_config(cfg: TrainConfig) -> None:
    """Parse the engine's config now, so what it refuses (offload at stage 0, offload with SGD, ...)
    stops the run before any process group starts, not after every rank built its model."""
    from megazero.zero.config import ZeroConfigError

    try:
        cfg.zero_config()
    except ZeroConfigError as e:
        raise ConfigError(f"{e} (--zero-stage {cfg.parallel.zero_stage})") from None


def check_vocab(config: TrainConfig, tokenizer_vocab_size: int) -> None:
    """Refuse a tokenizer (or data) vocabulary larger than the model's embedding.

    Call after building the tokenizer: ids >= padded_vocab_size would index past
    the embedding table (a CUDA assert deep in the first forward otherwise).
    """
    padded = config.model.padded_vocab_size
    if tokenizer_vocab_size > padded:
        raise ConfigError(
            f"the tokenizer has {tokenizer_vocab_size} tokens but the model's embedding has only {padded} rows "
            f"(vocab_size {config.model.vocab_size} padded to a multiple of "
            f"{config.model.make_vocab_size_divisible_by}); pass --vocab-size >= {tokenizer_vocab_size} "
            f"or drop --vocab-size to take it from the tokenizer")


def parse_args_or_exit(argv: Optional[Sequence[str]] = None, world_size: Optional[int] = None, *,
                       check_files: bool = True) -> TrainConfig:
    """``parse_args`` for entry points: on ConfigError log only the message (ERROR) and exit 2.

    Only local rank 0 logs it, so a multi-GPU node shows the message once, and leaves it in
    torchrun's error file, whose summary then ends with it (``output.write_error_file``; torchrun's
    own status is 1, the summary's root cause shows this rank's 2). The other ranks, which fail the
    same way, wait a moment before exiting: a launcher stops every rank when the first one exits, and
    a rank 0 stopped before it logged would leave the user no message; and torchrun's root cause is
    the first rank to exit.
    """
    try:
        return parse_args(argv, world_size, check_files=check_files)
    except ConfigError as e:
        if os.environ.get("LOCAL_RANK", "0") == "0":
            write_error_file(f"error: {e}")
            # The process exits next: the message reaches stderr whatever logging the caller set up.
            with console(__name__):
                log.error(f"error: {e}")
        else:
            time.sleep(5.0)  # rank 0 exits first (torchrun then stops this one)
        sys.exit(2)


def _exchanges(p) -> str:
    """The context-parallel exchange(s) as the start-up line shows them."""
    kinds = p.cp_comm_type if isinstance(p.cp_comm_type, str) else "/".join(p.cp_comm_types) + " by layer"
    return kinds + (f" {p.hierarchical_cp[0]}x{p.hierarchical_cp[1]}" if p.hierarchical_cp else "")


def _latents(m: GPTConfig) -> str:
    """Multi-latent attention's sizes, as the start-up line shows them."""
    q = f"q latent {m.q_lora_rank}" if m.q_lora_rank else "no q latent"
    return (f"(multi-latent: {q}, kv latent {m.kv_lora_rank}, qk {m.qk_head_dim}+{m.qk_pos_emb_head_dim}, "
            f"v {m.v_head_dim})")


def _attention_pattern(m) -> str:
    """The windows and sinks as the start-up line shows them (empty for full causal attention)."""
    sliding = sum(m.layer_window(i) is not None for i in range(m.num_layers))
    out = (f"; {sliding} of {m.num_layers} layers slide over {m.window_size[0] + 1} keys"
           if m.window_size is not None else "")
    return out + (f"; attention sinks ({m.softmax_type})" if m.softmax_type != "vanilla" else "")


_KIND_NAMES = (("mamba", "Mamba-2"), ("gdn", "Gated DeltaNet"), ("attention", "attention"), ("dense", "MLP"),
               ("moe", "MoE"))


def _layer_kinds(m: GPTConfig) -> list[str]:
    """The start-up line of a model whose layers differ in kind (a hybrid pattern, or Gated DeltaNet among the
    attention layers) and their sizes; none for a model of attention layers."""
    kinds = [m.layer_kinds(i) for i in range(m.num_layers)]
    mixers = Counter("attention" if k.mixer in ("standard", "mla") else k.mixer for k in kinds if k.mixer)
    if m.hybrid_layer_pattern is None and not mixers["gdn"] and not mixers["kda"]:
        return ["attention output gated"] if m.attention_output_gate else []
    if m.hybrid_layer_pattern is not None:
        counts = mixers + Counter(k.mlp for k in kinds if k.mlp)
        line = (f"hybrid: {m.num_layers} layers {m.hybrid_layer_pattern} ("
                + ", ".join(f"{counts[key]} {name}" for key, name in _KIND_NAMES if counts[key]) + ")")
    else:
        every, kind = m.linear_attention_freq, "kda" if mixers["kda"] else "gdn"
        line = f"{'KDA' if kind == 'kda' else 'Gated DeltaNet'} in {mixers[kind]} of {m.num_layers} layers" + (
            f" (attention every {every} layers)" if isinstance(every, int) else "")
    if mixers["mamba"]:
        line += (f"; Mamba-2 {m.mamba_heads} heads x {m.mamba_head_dim}, state {m.mamba_state_dim}, "
                 f"{m.mamba_num_groups} groups, conv {m.linear_conv_kernel_dim}")
    if mixers["gdn"]:
        sizes = (f"{m.linear_num_key_heads} key heads x {m.linear_key_head_dim}, {m.linear_num_value_heads} value "
                 f"heads x {m.linear_value_head_dim}, conv {m.linear_conv_kernel_dim}")
        line += f"; Gated DeltaNet {sizes}" if m.hybrid_layer_pattern is not None else f"; {sizes}"
    if mixers["kda"]:
        ranks = ", ".join(f"{what} rank {r}" for what, r in (("decay", m.kda_f_lora_rank),
                                                            ("gate", m.kda_gate_lora_rank)) if r is not None)
        line += (f"; {m.linear_num_key_heads} heads x {m.linear_key_head_dim} (values {m.linear_value_head_dim}), "
                 f"conv {m.linear_conv_kernel_dim}" + (f", {ranks}" if ranks else ""))
    return [line + ("; attention output gated" if m.attention_output_gate else "")]


def _optimizer(o: OptimConfig) -> str:
    """The optimizer and its own settings, as the start-up line shows them (its component says)."""
    return component(o.type).describe(o)


def describe(config: TrainConfig) -> str:
    """A few human lines summarising the resolved run (printed at startup and by dry runs); a plan
    whose run length or learning rate are placeholders (``parse_args(planning=True)``) shows neither."""
    m, p, s, o = config.model, config.parallel, config.schedule, config.optim
    training = not any(n.startswith(PLANNING_NOTE) for n in config.notes)
    lines = [
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        + (_latents(m) if m.multi_latent_attention else f"({m.query_groups} kv groups)")
        + f", ffn {m.ffn_size}, seq {m.seq_length}, vocab {m.vocab_size} "
        f"(padded {m.padded_vocab_size}), {m.position_embedding_type}/{m.normalization}/{m.activation}"
        + (f" (YaRN x{m.rotary_scaling_factor:g})" if m.resolved_rope_type == "yarn" else "")
        + (f" (Llama 3 scaling x{m.rotary_scaling_factor:g}, low {m.low_freq_factor:g}, high {m.high_freq_factor:g}, "
           f"original {m.original_max_position_embeddings})" if m.resolved_rope_type == "llama3" else "")
        + _attention_pattern(m)
        + (f"; {sum(m.is_moe_layer(i) for i in range(m.num_layers))} of {m.num_layers} layers mixtures of "
           f"{m.num_experts} experts, top-{m.moe_router_topk}" if m.num_experts else "")
        + (f"; {m.mtp_num_layers} multi-token prediction module{'s' if m.mtp_num_layers > 1 else ''} "
           f"(weight {m.mtp_loss_scaling_factor:g})" if m.mtp_num_layers else ""),
        *_layer_kinds(m),
        f"parallel: world {p.world_size} = tp {p.tp} x "
        + (f"cp {p.cp} ({_exchanges(p)}) x " if p.cp > 1 else "")
        + f"pp {p.pp} x dp {p.dp}" + (f" (experts: etp {p.etp} x ep {p.ep} x expert-dp {p.dp * p.cp * p.tp // (p.ep * p.etp)})"
                                        if p.ep > 1 or p.etp != p.tp else "")
        + f", ZeRO stage {p.zero_stage}, "
        f"sequence parallel {'on' if p.sequence_parallel else 'off'}, precision {config.precision.dtype}, "
        f"recompute {m.recompute_granularity or 'none'}, attention {m.attention_backend}",
        f"batch: global {s.global_batch_size} = micro {s.micro_batch_size} x dp {p.dp} x accumulation "
        f"{s.grad_accum_steps}"
        + (f"; {s.train_iters} iterations ({s.train_samples} samples, {s.train_samples * m.seq_length:,} tokens)"
           if training else "")
        + (f"; ramp-up {s.rampup_batch_size[0]} +{s.rampup_batch_size[1]} over {s.rampup_batch_size[2]} samples"
           if s.rampup_batch_size else "")
        + (f"; stop at {s.train_tokens:,} tokens" if s.train_tokens else ""),
        *([f"pipeline: {pipeline_plan_line(config)}"] if p.pp > 1 else []),
        *([f"lr: {o.lr:g} -> {o.min_lr:g} {s.lr_decay_style}, warmup {s.lr_warmup_samples} {s.lr_unit}, decay "
           f"{s.lr_decay_samples} {s.lr_unit}; {_optimizer(o)}, wd {o.weight_decay}, clip {o.clip_grad}"]
          if training else []),
    ]
    return "\n".join(lines)
