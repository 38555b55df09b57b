"""Parallel layout: tp x pp x dp, ZeRO stage, sequence parallel, backend; the pipeline's stages and chunks."""

from __future__ import annotations

import argparse
import math
import os
from typing import Optional

import torch

from megazero.config.resolve.common import default
from megazero.config.train_config import ConfigError, ParallelConfig, ScheduleConfig, TrainConfig
from megazero.model.config import GPTConfig

MIN_TIMEOUT_S = 10.0  # --distributed-timeout-minutes' floor


def timeout_problem(minutes: float) -> Optional[str]:
    """What is wrong with ``--distributed-timeout-minutes minutes``, with the fix (None: nothing), for
    every program that launches ranks."""
    if not (minutes > 0 and math.isfinite(minutes)):
        return (f"--distributed-timeout-minutes must be a positive number of minutes, got {minutes:g}: give the "
                "longest a rank may wait for its peers, e.g. 10 (Megatron-LM's default)")
    if minutes * 60 < MIN_TIMEOUT_S:  # the rendezvous and the heartbeats (every few seconds) need this much
        return (f"--distributed-timeout-minutes {minutes:g} is {minutes * 60:.2g} s, too short to join the "
                f"rendezvous and tell a hung rank from a slow one: give at least {MIN_TIMEOUT_S / 60:.2f} "
                f"({MIN_TIMEOUT_S:g} s), e.g. 10 (Megatron-LM's default)")
    return None


def check_local_rank(ns: argparse.Namespace) -> None:
    """The `deepspeed` launcher and torch.distributed.launch pass --local_rank=N and also set LOCAL_RANK;
    the environment is what megazero reads, so the two must agree."""
    env = os.environ.get("LOCAL_RANK")
    if ns.local_rank is not None and env is not None and int(env) != ns.local_rank:
        raise ConfigError(f"--local_rank={ns.local_rank} disagrees with LOCAL_RANK={env} in the environment; "
                          f"launch with torchrun, deepspeed or srun, which set both consistently")


def resolve_parallel(ns: argparse.Namespace, world_size: int, notes: list[str], check_files: bool) -> ParallelConfig:
    tp, pp = default(ns.tp, 1), default(ns.pp, 1)
    if world_size < 1:
        raise ConfigError(f"world size must be >= 1, got {world_size}")
    if tp < 1 or pp < 1:
        raise ConfigError(f"--tp and --pp must be >= 1, got --tp {tp} --pp {pp}")
    if ns.no_pipeline_parallel and pp > 1:
        raise ConfigError(f"--no-pipeline-parallel (Megatron-DeepSpeed: pipeline size 1) contradicts "
                          f"--pipeline-model-parallel-size {pp}; drop one of them")
    for flag_name, value in (("--virtual-pipeline-model-parallel-size", ns.virtual_pipeline_model_parallel_size),
                             ("--num-layers-per-virtual-pipeline-stage", ns.num_layers_per_virtual_pipeline_stage),
                             ("--decoder-first-pipeline-num-layers", ns.decoder_first_pipeline_num_layers),
                             ("--decoder-last-pipeline-num-layers", ns.decoder_last_pipeline_num_layers)):
        if value is not None and pp == 1:
            raise ConfigError(f"{flag_name} {value} needs a pipeline (--pipeline-model-parallel-size > 1), got --pp 1")
    cp = default(ns.context_parallel_size, 1)
    if cp < 1:
        raise ConfigError(f"--context-parallel-size must be >= 1, got {cp}")
    if world_size % (tp * cp * pp):
        what = f"--tp {tp} x --pp {pp}" + (f" x --context-parallel-size {cp}" if cp > 1 else "")
        sizes = [flag for flag, size in (("--tp", tp), ("--pp", pp), ("--context-parallel-size", cp)) if size > 1]
        raise ConfigError(f"world size {world_size} is not divisible by {what} = {tp * cp * pp}; "
                          f"launch a multiple of {tp * cp * pp} processes or change {' or '.join(sizes)}")
    comm_types = [t.lower() for t in (ns.cp_comm_type or ["p2p"])]
    unknown = sorted(set(comm_types) - {"p2p", "a2a", "allgather", "a2a+p2p"})
    if unknown:
        raise ConfigError(f"--cp-comm-type {' '.join(unknown)}: choose p2p, a2a, allgather or a2a+p2p")
    hierarchical = tuple(ns.hierarchical_context_parallel_sizes or ())
    if "a2a+p2p" in comm_types:
        if len(hierarchical) != 2 or hierarchical[0] * hierarchical[1] != cp:
            raise ConfigError(f"--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P (the "
                              f"all-to-all and ring sizes) with A x P = --context-parallel-size {cp}, got "
                              f"{' '.join(map(str, hierarchical)) or 'none'}")
    elif hierarchical:
        raise ConfigError("--hierarchical-context-parallel-sizes is for --cp-comm-type a2a+p2p; drop it or "
                          "choose a2a+p2p")
    ep = default(ns.expert_model_parallel_size, 1)
    etp = default(ns.expert_tensor_parallel_size, tp)
    if ep < 1 or etp < 1:
        raise ConfigError(f"--expert-model-parallel-size ({ep}) and --expert-tensor-parallel-size ({etp}) must be >= 1")
    zero_stage = ns.zero_stage
    fsdp_stage = _fully_sharded_stage(ns)
    if zero_stage is None and fsdp_stage is not None:
        zero_stage = fsdp_stage
        notes.append(f"--use-megatron-fsdp: ZeRO stage {fsdp_stage} (fully sharded data parallel)")
    if ns.use_distributed_optimizer:
        if zero_stage == 0:
            raise ConfigError("--use-distributed-optimizer (optimizer states sharded over data parallel, i.e. "
                              "ZeRO-1) contradicts --zero-stage 0; drop one of them")
        if zero_stage is None:
            zero_stage = 1
            notes.append("--use-distributed-optimizer: ZeRO stage 1 (optimizer states sharded over data parallel)")
    zero_stage = default(zero_stage, 1)
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero-stage must be 0, 1, 2 or 3, got {zero_stage}")
    sp = bool(ns.sequence_parallel)
    if sp and tp == 1:  # Megatron-LM's rule (its Mixtral script passes both): no TP group to shard over
        sp = False
        notes.append("--sequence-parallel with --tp 1: off (there is no tensor-parallel group to shard the "
                     "activations over), as Megatron-LM turns it off")
    backend = ns.distributed_backend
    if backend == "nccl" and check_files and not torch.cuda.is_available():
        raise ConfigError("--distributed-backend nccl needs CUDA GPUs and none is visible; use "
                          "--distributed-backend gloo to run on CPUs")
    timeout = default(ns.distributed_timeout_minutes, 10.0)
    problem = timeout_problem(timeout)
    if problem:
        raise ConfigError(problem)
    return ParallelConfig(tp=tp, pp=pp, dp=world_size // (tp * cp * pp), cp=cp, distributed_timeout_minutes=timeout,
                          cp_comm_type=comm_types[0] if len(set(comm_types)) == 1 else tuple(comm_types),
                          hierarchical_cp=hierarchical, ep=ep, etp=etp,
                          world_size=world_size,
                          zero_stage=zero_stage, sequence_parallel=sp, distributed_backend=backend,
                          decoder_first_pipeline_num_layers=ns.decoder_first_pipeline_num_layers,
                          decoder_last_pipeline_num_layers=ns.decoder_last_pipeline_num_layers)


def resolve_pipeline(ns: argparse.Namespace, par: ParallelConfig, model: GPTConfig, schedule: ScheduleConfig) -> None:
    """Virtual stages and the layer split, checked against the layers and micro-batches before any collective."""
    from megazero.model.pipeline_split import (
        PipelineSplitError,
        layers_per_chunk_table,
        virtual_stages_from_layers_per_stage,
    )

    if par.pp == 1:
        return
    v_given, per_chunk = ns.virtual_pipeline_model_parallel_size, ns.num_layers_per_virtual_pipeline_stage
    try:
        segments = model.pipeline_segments
        v = 1 if v_given is None else v_given
        if segments is not None:
            _check_segments(ns, par, len(segments), model.hybrid_layer_pattern)
            v = len(segments) // par.pp  # the pattern's cuts give each rank its chunks (Megatron's)
        if per_chunk is not None:
            if par.decoder_first_pipeline_num_layers is not None or par.decoder_last_pipeline_num_layers is not None:
                raise ConfigError("--num-layers-per-virtual-pipeline-stage assumes an even split; with "
                                  "--decoder-first/last-pipeline-num-layers give --virtual-pipeline-model-parallel-size")
            v = virtual_stages_from_layers_per_stage(model.num_layers, par.pp, per_chunk)
            if v_given is not None and v_given != v:
                raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_chunk} gives {v} model chunks per "
                                  f"rank ({model.num_layers} layers / (pp {par.pp} x {per_chunk})) but "
                                  f"--virtual-pipeline-model-parallel-size is {v_given}; give one of them")
        if v < 1:
            raise ConfigError(f"--virtual-pipeline-model-parallel-size must be >= 1, got {v}")
        if segments is None:
            _account_for_ends(ns, par, model.num_layers, v)
        layers_per_chunk_table(model.num_layers, par.pp, v, par.decoder_first_pipeline_num_layers,
                               par.decoder_last_pipeline_num_layers, segments)
    except PipelineSplitError as e:
        raise ConfigError(f"pipeline layout: {e}") from None
    group = ns.microbatch_group_size_per_virtual_pipeline_stage
    if v > 1 and group is not None and group != par.pp:
        raise ConfigError(f"--microbatch-group-size-per-virtual-pipeline-stage {group}: megazero's interleaved 1F1B "
                          f"runs micro-batches in groups of pp = {par.pp} (Megatron's default); pass {par.pp} or drop "
                          "the flag")
    m = schedule.grad_accum_steps
    if v > 1:
        per_micro = schedule.micro_batch_size * par.dp
        sizes = [m] + ([schedule.rampup_batch_size[0] // per_micro, schedule.rampup_batch_size[1] // per_micro]
                       if schedule.rampup_batch_size else [])
        for n in sizes:
            if n % par.pp:
                raise ConfigError(
                    f"interleaved 1F1B (v = {v}) runs micro-batches in groups of pp = {par.pp}, but a step has {n} "
                    f"micro-batches (global batch / (micro batch {schedule.micro_batch_size} x dp {par.dp})); use a "
                    f"--global-batch-size giving a multiple of {par.pp} micro-batches, or drop the virtual stages")
    par.virtual_pp = v


def _check_segments(ns: argparse.Namespace, par: ParallelConfig, segments: int, pattern: str) -> None:
    """A hybrid pattern cut by '|' places every (virtual) stage's layers: its segments a multiple of pp, and no
    other way to split given beside it (as Megatron asserts)."""
    if segments % par.pp:
        raise ConfigError(f"--hybrid-layer-pattern {pattern} has {segments} pipeline segments ('|' cuts) for --pp "
                          f"{par.pp}: cut it into a multiple of {par.pp} segments (segments / pp model chunks per "
                          "rank), or leave out the '|' for an even split")
    other = [flag for flag, given in (
        ("--num-layers-per-virtual-pipeline-stage", ns.num_layers_per_virtual_pipeline_stage is not None),
        ("--decoder-first-pipeline-num-layers", par.decoder_first_pipeline_num_layers is not None),
        ("--decoder-last-pipeline-num-layers", par.decoder_last_pipeline_num_layers is not None),
        ("--account-for-embedding-in-pipeline-split", ns.account_for_embedding_in_pipeline_split),
        ("--account-for-loss-in-pipeline-split", ns.account_for_loss_in_pipeline_split)) if given]
    v_given = ns.virtual_pipeline_model_parallel_size
    if v_given is not None and v_given != segments // par.pp:
        other.append(f"--virtual-pipeline-model-parallel-size {v_given}")
    if other:
        raise ConfigError(f"{', '.join(other)} beside the '|' cuts of --hybrid-layer-pattern, which place every "
                          f"stage's layers ({segments} segments / --pp {par.pp} = {segments // par.pp} chunks per "
                          "rank): drop it, or the cuts")


_SHARDING_STAGES = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def _fully_sharded_stage(ns: argparse.Namespace) -> Optional[int]:
    """The ZeRO stage --use-megatron-fsdp / --use-torch-fsdp2 mean (--data-parallel-sharding-strategy's, by default
    Megatron-FSDP's optim_grads_params: 3); None without them. A --zero-stage that disagrees is refused."""
    strategy = ns.data_parallel_sharding_strategy
    if not ns.use_megatron_fsdp:
        if strategy is not None:
            raise ConfigError(f"--data-parallel-sharding-strategy {strategy} is Megatron-FSDP's: add "
                              "--use-megatron-fsdp, or give the ZeRO stage with --zero-stage")
        return None
    stage = _SHARDING_STAGES[strategy or "optim_grads_params"]
    if ns.zero_stage is not None and ns.zero_stage != stage:
        raise ConfigError(f"--use-megatron-fsdp with sharding {strategy or 'optim_grads_params'} is ZeRO stage "
                          f"{stage}, which contradicts --zero-stage {ns.zero_stage}; drop one of them")
    return stage


def _account_for_ends(ns: argparse.Namespace, par: ParallelConfig, num_layers: int, v: int) -> None:
    """--account-for-embedding/loss-in-pipeline-split (Megatron-core's split, the embedding and the loss counted
    as a layer each): the first / last stage's layers, (num_layers + counted) / pp - 1."""
    ends = [(flag, stage) for flag, stage, given in (
        ("--account-for-embedding-in-pipeline-split", "first", ns.account_for_embedding_in_pipeline_split),
        ("--account-for-loss-in-pipeline-split", "last", ns.account_for_loss_in_pipeline_split)) if given]
    if not ends:
        return
    names = " and ".join(flag for flag, _ in ends)
    if par.decoder_first_pipeline_num_layers is not None or par.decoder_last_pipeline_num_layers is not None:
        raise ConfigError(f"{names} with --decoder-first/last-pipeline-num-layers: give one way to split the layers "
                          "(Megatron refuses both too)")
    if v > 1:
        raise ConfigError(f"{names} with {v} virtual pipeline stages: megazero splits each stage's layers evenly over "
                          "its chunks; give --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers "
                          f"(multiples of {v}) instead")
    counted = num_layers + len(ends)
    if counted % par.pp:
        raise ConfigError(f"{names}: {num_layers} layers + {len(ends)} = {counted} is not divisible by "
                          f"--pipeline-model-parallel-size {par.pp}")
    for _, stage in ends:
        setattr(par, f"decoder_{stage}_pipeline_num_layers", counted // par.pp - 1)


def pipeline_plan_line(config: TrainConfig) -> str:
    """The layers of each pipeline stage (and chunk), the schedule and its bubble, for the start-up plan."""
    from megazero.model.pipeline_split import layers_per_chunk_table

    p, m = config.parallel, config.schedule.grad_accum_steps
    table = layers_per_chunk_table(config.model.num_layers, p.pp, p.virtual_pp, p.decoder_first_pipeline_num_layers,
                                   p.decoder_last_pipeline_num_layers, config.model.pipeline_segments)

    def span(r: range) -> str:
        return f"{r.start}-{r.stop - 1}" if len(r) > 1 else (str(r.start) if len(r) else "none")

    stages = []
    for r in range(p.pp):
        parts = "+".join(span(table[c][r]) for c in range(p.virtual_pp))
        ends = ("embedding " if r == 0 else "") + ("head" if r == p.pp - 1 else "")
        stages.append(f"stage {r}: layers {parts}" + (f" ({ends.strip()})" if ends else ""))
    kind = "1F1B" if p.virtual_pp == 1 else f"interleaved 1F1B, {p.virtual_pp} chunks per rank"
    return (f"{kind}, {m} micro-batches per step, bubble (pp-1)/(v m) = {(p.pp - 1) / (p.virtual_pp * m):.3f}; "
            + "; ".join(stages))


def resolve_expert_parallel(par: ParallelConfig, model: GPTConfig) -> None:
    """What the expert-parallel and expert tensor-parallel sizes need of the model (its experts come from
    --num-experts or from the checkpoint the run starts from) and of the ranks, refused with the numbers."""
    ep, etp, tp, experts = par.ep, par.etp, par.tp, model.num_experts
    if (ep > 1 or etp != tp) and not experts:
        flag = (f"--expert-model-parallel-size {ep}" if ep > 1 else f"--expert-tensor-parallel-size {etp}")
        raise ConfigError(f"{flag} needs --num-experts (a mixture of experts): the model has none")
    if not experts:
        return
    if experts % ep:
        raise ConfigError(f"the model's {experts} experts (--num-experts) are not divisible by "
                          f"--expert-model-parallel-size {ep}")
    stage = par.tp * par.dp * par.cp
    if stage % (ep * etp):
        raise ConfigError(f"--expert-model-parallel-size {ep} x --expert-tensor-parallel-size {etp} = {ep * etp} must "
                          f"divide the ranks of a pipeline stage, tp x dp x cp = {tp} x {par.dp} x {par.cp} = {stage}")
    if model.moe_ffn_size % etp:
        raise ConfigError(f"the experts' hidden size {model.moe_ffn_size} (--moe-ffn-hidden-size, else "
                          f"--ffn-hidden-size) is not divisible by --expert-tensor-parallel-size {etp}")
    if etp not in (1, tp) and model.add_bias_linear:
        raise ConfigError(f"expert biases with --expert-tensor-parallel-size {etp} between 1 and --tp {tp}: each "
                          "expert's output bias would be held by etp ranks that the gradient norm does not tell apart; "
                          "add --disable-bias-linear, or use an expert tensor-parallel size of 1 or --tp")
    if etp != tp and tp > 1 and not par.sequence_parallel:
        raise ConfigError(f"--expert-tensor-parallel-size {etp} differs from --tp {tp}: each rank then routes "
                          "tokens of its own, which needs --sequence-parallel (as in Megatron-LM); add it, or set "
                          f"--expert-tensor-parallel-size {tp}")


def context_parallel_dropout_note(cp: int, model: GPTConfig) -> str:
    """What dropout does under context parallelism (the start-up note), or '' when there is none."""
    if cp == 1 or model.hidden_dropout == 0 and model.attention_dropout == 0:
        return ""
    if model.dropout_rng == "position":
        if model.attention_dropout == 0:
            return ""
        return (f"dropout under --context-parallel-size {cp}: masks keyed by position (--dropout-rng position), the "
                f"same at every layout; attention with dropout {model.attention_dropout:g} runs the explicit "
                "formula in tiles, slower than the fused kernels (--dropout-rng stream or --attention-dropout 0 "
                "runs those)")
    return (f"dropout under --context-parallel-size {cp}: each rank draws its own masks, which depend on the layout "
            "(as in Megatron-LM); --dropout-rng position makes them the same at every layout (its attention "
            "dropout runs the explicit formula in tiles, slower than the fused kernels)")


def resolve_context_parallel(par: ParallelConfig, model: GPTConfig, notes: list[str]) -> None:
    """What context parallelism needs of the model and the data, refused at parse time with the numbers;
    what its dropout does goes to ``notes`` (the start-up lines)."""
    cp = par.cp
    if cp == 1:
        return
    s = model.seq_length
    if s % (2 * cp):
        raise ConfigError(f"--seq-length {s} is not divisible by 2 x --context-parallel-size = {2 * cp} (each "
                          f"sequence is split into 2 x cp balanced chunks); use a multiple of {2 * cp}")
    note = context_parallel_dropout_note(cp, model)
    if note:
        notes.append(note)
    kinds = par.cp_comm_type
    if not isinstance(kinds, str) and len(kinds) != model.num_layers:
        raise ConfigError(f"--cp-comm-type gives {len(kinds)} exchanges for {model.num_layers} layers: give one value "
                          f"for every layer, or one per layer")
    heads, groups = model.num_attention_heads // par.tp, model.query_groups // par.tp
    for kind in par.cp_comm_types:
        if kind not in ("a2a", "a2a+p2p"):
            continue
        from megazero.model.attention.cp.exchanges import a2a_head_split

        over = cp if kind == "a2a" else par.hierarchical_cp[0]
        try:
            a2a_head_split(heads, groups, over)
        except ValueError as e:
            raise ConfigError(f"--cp-comm-type {kind} with {heads} heads and {groups} key/value groups per "
                              f"tensor-parallel rank over {over} all-to-all ranks: {e}; use --cp-comm-type p2p "
                              "or allgather") from e
