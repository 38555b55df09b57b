"""DeepSpeed JSON keys as data: honoured, mapped, refused, or ignored (DeepSpeed-internal tuning).

``classify(ds)`` walks a loaded ``--deepspeed_config`` before ``torch.distributed``
starts and returns the ignored keys (for one start-up line) or raises ``ConfigError``
for refused and unknown keys. ``strip_ignored(ds)`` removes the ignored keys before
the JSON goes to the ZeRO engine, so the engine sees only keys with a meaning.
The table is also printed in docs/flags.md.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megazero.config.errors import ConfigError

__all__ = ["DSKey", "DS_KEYS", "classify", "strip_ignored"]

HONOURED, MAPPED, REFUSED, IGNORED = "honoured", "mapped", "refused", "ignored"


@dataclass(frozen=True)
class DSKey:
    path: str  # dotted; a path ending in '.*' covers every key of that block
    status: str
    meaning: str
    # For conditionally refused keys: value -> refuse? (e.g. offload with device 'none' is fine).
    refuse_if: Optional[Callable[[Any], bool]] = None


def _enabled(v: Any) -> bool:
    return bool(v.get("enabled", False)) if isinstance(v, dict) else bool(v)


_K = DSKey
_INTERNAL = "tunes DeepSpeed's own internals; megazero communicates per unit (a layer) and has no such knob"
DS_KEYS: tuple[DSKey, ...] = (
    _K("train_batch_size", HONOURED, "= --global-batch-size (must agree)"),
    _K("train_micro_batch_size_per_gpu", HONOURED, "= --micro-batch-size (must agree)"),
    _K("gradient_accumulation_steps", HONOURED, "derives the global batch when --global-batch-size is absent"),
    _K("optimizer.type", HONOURED, "a registered optimizer, any case (= --optimizer; docs/optimizers.md lists them)"),
    _K("optimizer.params.lr", HONOURED, "= --lr"),
    _K("optimizer.params.betas", HONOURED, "= --adam-beta1/--adam-beta2, or the optimizer's own beta flags where it "
       "has them (docs/optimizers.md)"),
    _K("optimizer.params.eps", HONOURED, "= --adam-eps"),
    _K("optimizer.params.weight_decay", HONOURED, "= --weight-decay"),
    _K("optimizer.params.momentum", HONOURED, "= the optimizer's own momentum flag (--sgd-momentum, --muon-momentum)"),
    _K("optimizer.params.muon_lr", HONOURED, "Muon: the matrices' peak lr (default: lr); the schedule scales both"),
    _K("optimizer.params.adam_lr", HONOURED, "Muon: the auxiliary AdamW's peak lr (default: lr)"),
    _K("optimizer.params.torch_adam", IGNORED, "selects DeepSpeed's Adam kernel; megazero uses torch's/apex's"),
    _K("optimizer.params.adam_w_mode", HONOURED, "decoupled weight decay (true, the default) or L2 (false)"),
    _K("scheduler.type", MAPPED, "WarmupLR / WarmupDecayLR / WarmupCosineLR become --lr-decay-style constant / "
       "linear / cosine with their warmup (linear warmup_type only); other types are refused"),
    _K("scheduler.params.*", MAPPED, "warmup_min_lr, warmup_max_lr, warmup_num_steps, total_num_steps, "
       "warmup_min_ratio, cos_min_ratio, warmup_type -> the --lr* flags (in iterations)"),
    _K("zero_optimization.stage", HONOURED, "= --zero-stage"),
    _K("zero_optimization.overlap_comm", HONOURED, "ZeRO-2/3: gradient reduce-scatters run asynchronously while "
       "backward goes on (default true)"),
    _K("zero_optimization.reduce_bucket_size", HONOURED, "ZeRO-2/3: gradients of finished units are reduce-scattered "
       "in buckets of at least this many elements (default: each unit a bucket of its own)"),
    _K("zero_optimization.max_reduce_in_flight", HONOURED, "megazero's: gradient buckets being reduced at once before "
       "the oldest is waited for (default 1)"),
    _K("zero_optimization.stage3_prefetch_bucket_size", HONOURED, "ZeRO-3: elements all-gathered ahead of the unit in "
       "use (default: the next unit, as FSDP2 prefetches)"),
    _K("zero_optimization.stage3_max_live_parameters", HONOURED, "ZeRO-3: elements gathered at once, the unit in use "
       "excepted; caps the prefetch (default: no cap beyond the prefetch)"),
    _K("zero_optimization.stage3_param_persistence_threshold", HONOURED, "ZeRO-3: parameters of at most this many "
       "elements stay gathered (default 1e5)"),
    _K("zero_optimization.stage3_keep_gathered_in_step", HONOURED, "megazero's ZeRO-3 x pipeline policy: units stay "
       "gathered across a step's micro-batches and gradients are reduce-scattered once per step (default false; "
       "see README)"),
    *(_K(f"zero_optimization.{k}", IGNORED, _INTERNAL) for k in (
        "allgather_bucket_size", "contiguous_gradients", "reduce_scatter",
        "stage3_max_reuse_distance", "sub_group_size",
        "allgather_partitions", "elastic_checkpoint", "round_robin_gradients", "load_from_fp32_weights",
        "stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
        "ignore_unused_parameters", "cpu_offload_params", "cpu_offload_use_pin_memory", "memory_efficient_linear",
        "use_multi_rank_bucket_allreduce", "mics_shard_size", "mics_hierarchical_params_gather",
        "legacy_stage1", "pipeline_loading_checkpoint")),
    _K("zero_optimization.offload_optimizer.device", HONOURED, "ZeRO-Offload / ZeRO-Infinity: the fp32 masters and "
       "Adam moments of this rank's partition on the host (cpu) or in files under nvme_path (nvme); stages 1-3, "
       "every layout; = --optimizer-cpu-offload (cpu)"),
    _K("zero_optimization.offload_optimizer.nvme_path", HONOURED, "directory of the nvme state files (one directory "
       "per rank, stable names reused across runs)"),
    _K("zero_optimization.offload_optimizer.pin_memory", HONOURED, "pin the host state and the step's ring (falls "
       "back to pageable memory, with a note, where pinning is impossible)"),
    _K("zero_optimization.offload_optimizer.buffer_count", HONOURED, "host buffers in the step's ring (default 4): "
       "chunks in flight between accelerator, host and NVMe"),
    _K("zero_optimization.offload_optimizer.buffer_size", HONOURED, "megazero's: elements per ring buffer (rounded "
       "down to a multiple of 4096); unset, 2^20 lowered so the ring holds at most 1/8 of the offloaded state; never "
       "above the largest offloaded group"),
    _K("zero_optimization.offload_optimizer.ratio", HONOURED, "fraction of the partition offloaded, by whole groups "
       "in model order (default 1); = --optimizer-offload-fraction"),
    *(_K(f"zero_optimization.offload_optimizer.{k}", IGNORED, "tunes DeepSpeed's swapper; megazero's ring always "
         "pipelines reads, steps and writes") for k in ("fast_init", "pipeline_read", "pipeline_write")),
    _K("zero_optimization.offload_param.device", HONOURED, "ZeRO-Infinity, stage 3: this rank's partition of the "
       "parameters (compute dtype) on the host (cpu) or in files under nvme_path (nvme) between its all-gathers; "
       "every layout"),
    _K("zero_optimization.offload_param.nvme_path", HONOURED, "directory of the parameter files (one directory per "
       "rank, stable names reused across runs)"),
    _K("zero_optimization.offload_param.pin_memory", HONOURED, "pin the host copies and the read buffers (falls back "
       "to pageable memory, with a note, where pinning is impossible)"),
    _K("zero_optimization.offload_param.buffer_count", HONOURED, "host buffers NVMe reads go through (default 5)"),
    _K("zero_optimization.offload_param.buffer_size", HONOURED, "elements per NVMe buffer; unset, 2^20 (never above "
       "DeepSpeed's 1e8) lowered so the buffers hold at most 1/8 of what is on NVMe; capped at the largest offloaded "
       "partition"),
    _K("zero_optimization.offload_param.max_in_cpu", HONOURED, "nvme: elements of the partition, in model order, "
       "kept in host memory instead of files (default 1e9)"),
    _K("zero_optimization.cpu_offload", REFUSED, "DeepSpeed's legacy key; write zero_optimization.offload_optimizer: "
       "{\"device\": \"cpu\"} (and offload_param for the parameters)", refuse_if=bool),
    *(_K(f"zero_optimization.{k}", REFUSED, "ZeRO++ quantization/hierarchical partitioning does not exist in "
         "megazero; remove it", refuse_if=lambda v: bool(v) and v != 1) for k in (
        "zero_quantized_weights", "zero_quantized_gradients", "zero_hpz_partition_size")),
    _K("fp16.enabled", HONOURED, "= --fp16"),
    _K("fp16.loss_scale", HONOURED, "0 = dynamic; > 0 a static scale. With --deepspeed_config the fp16 block "
       "governs the loss scaler (as Megatron-DeepSpeed): --loss-scale beside a dynamic block is superseded "
       "with a note; an explicit disagreement is refused"),
    _K("fp16.initial_scale_power", HONOURED, "dynamic scale starts at 2**power (DeepSpeed default 16)"),
    _K("fp16.loss_scale_window", HONOURED, "= --loss-scale-window"),
    _K("fp16.hysteresis", HONOURED, "= --hysteresis"),
    _K("fp16.min_loss_scale", HONOURED, "= --min-loss-scale"),
    _K("fp16.consecutive_hysteresis", HONOURED, "reset hysteresis after a good step"),
    _K("fp16.auto_cast", REFUSED, "automatic input casting is not implemented; inputs are token ids",
       refuse_if=bool),
    _K("bf16.enabled", HONOURED, "= --bf16"),
    _K("bfloat16.enabled", HONOURED, "older spelling of bf16.enabled"),
    _K("bf16.immediate_grad_update", IGNORED, _INTERNAL),
    _K("gradient_clipping", HONOURED, "= --clip-grad"),
    _K("data_types.grad_accum_dtype", HONOURED, "dtype gradients accumulate in: fp32, fp16 or bf16 (default fp32 "
       "with bf16, else the compute dtype); fp32 = --accumulate-allreduce-grads-in-fp32"),
    _K("communication_data_type", HONOURED, "dtype the gradient reductions run in: fp32, fp16 or bf16 (default: the "
       "accumulation dtype)"),
    _K("prescale_gradients", HONOURED, "divide gradients by gradient_predivide_factor before the data-parallel "
       "reduction (keeps fp16 sums in range); the step multiplies it back"),
    _K("gradient_predivide_factor", HONOURED, "the divisor of prescale_gradients (default 1; no effect without it)"),
    _K("steps_per_print", MAPPED, "the --log-interval when that flag is absent"),
    _K("wall_clock_breakdown", HONOURED, "forward/backward/step time breakdown in every log line"),
    _K("memory_breakdown", MAPPED, "memory is in every log line; accepted"),
    _K("tensorboard.*", HONOURED, "enabled/output_path/job_name: --tensorboard-dir output_path/job_name"),
    _K("csv_monitor.*", HONOURED, "enabled/output_path/job_name: one CSV file per metric, as DeepSpeed writes"),
    _K("wandb.*", HONOURED, "enabled/project/group/team: --wandb-project (wandb must be installed)"),
    _K("activation_checkpointing.partition_activations", REFUSED, "partitioned activations do not exist in "
       "megazero; use --sequence-parallel", refuse_if=bool),
    _K("activation_checkpointing.contiguous_memory_optimization", REFUSED, "needs partition_activations, which "
       "megazero does not implement", refuse_if=bool),
    _K("activation_checkpointing.cpu_checkpointing", REFUSED, "CPU activation checkpointing does not exist in "
       "megazero", refuse_if=bool),
    _K("activation_checkpointing.number_checkpoints", MAPPED, "= --recompute-num-layers"),
    _K("activation_checkpointing.synchronize_checkpoint_boundary", IGNORED, _INTERNAL),
    _K("activation_checkpointing.profile", IGNORED, _INTERNAL),
    _K("sequence_parallel_size", MAPPED, "DeepSpeed-Ulysses: = --context-parallel-size with --cp-comm-type a2a "
       "(all-to-all over heads) unless --cp-comm-type is given"),
    _K("zero_allow_untested_optimizer", IGNORED, "DeepSpeed's guard for foreign optimizers; megazero builds its own"),
    _K("zero_force_ds_cpu_optimizer", IGNORED, "DeepSpeed's guard that offload runs its own CPU Adam; megazero's "
       "offload always steps torch's fused CPU AdamW"),
    _K("aio.*", IGNORED, "DeepSpeed's libaio tuning; megazero's NVMe offload uses plain pread/pwrite"),
    _K("checkpoint.*", IGNORED, "DeepSpeed checkpoint-engine options; megazero writes its own checkpoints"),
    _K("comms_logger.*", IGNORED, "DeepSpeed's communication logger; megazero counts bytes per collective itself"),
    _K("dump_state", IGNORED, "DeepSpeed debug print"),
    _K("flops_profiler.*", REFUSED, "DeepSpeed's flops profiler does not exist in megazero; the log line reports "
       "TFLOP/s per rank", refuse_if=_enabled),
    _K("amp.*", REFUSED, "NVIDIA apex AMP does not exist in megazero; use --bf16 or --fp16", refuse_if=_enabled),
    _K("sparse_attention.*", REFUSED, "sparse attention does not exist in megazero"),
    _K("compression_training.*", REFUSED, "compression training does not exist in megazero"),
    _K("curriculum_learning.*", REFUSED, "curriculum learning does not exist in megazero", refuse_if=_enabled),
    _K("data_efficiency.*", REFUSED, "DeepSpeed data efficiency does not exist in megazero", refuse_if=_enabled),
    _K("elasticity.*", REFUSED, "elastic batch sizes do not exist in megazero; use --rampup-batch-size",
       refuse_if=_enabled),
    _K("pipeline.*", IGNORED, "DeepSpeed pipeline-engine tuning; megazero has no pipeline yet (pp 1)"),
    _K("sparse_gradients", REFUSED, "sparse embedding gradients do not exist in megazero", refuse_if=bool),
)
_BY_PATH = {k.path: k for k in DS_KEYS}


def _lookup(path: str) -> Optional[DSKey]:
    if path in _BY_PATH:
        return _BY_PATH[path]
    parts = path.split(".")
    for i in range(len(parts) - 1, 0, -1):
        block = _BY_PATH.get(".".join(parts[:i]) + ".*")
        if block is not None:
            return block
    return None


def _walk(d: dict, prefix: str = ""):
    """(path, value) for leaves, and for blocks that a '.*' row covers as a whole."""
    for key, value in d.items():
        path = f"{prefix}{key}"
        if f"{path}.*" in _BY_PATH:
            yield path + ".*", value
        elif isinstance(value, dict) and path not in _BY_PATH:
            if not value:
                continue
            yield from _walk(value, path + ".")
        else:
            yield path, value


def classify(ds: dict[str, Any], source: str = "--deepspeed_config") -> list[str]:
    """Refuse unknown and refused keys (all at once); return the ignored keys' paths."""
    problems, ignored = [], []
    for path, value in _walk(ds):
        row = _lookup(path) if not path.endswith(".*") else _BY_PATH[path]
        shown = path[:-2] if path.endswith(".*") else path
        if row is None:
            problems.append(f"unknown key {shown!r} (not a DeepSpeed key megazero knows; see docs/flags.md)")
        elif row.status == REFUSED and (row.refuse_if is None or row.refuse_if(value)):
            problems.append(f"{shown}: {row.meaning}")
        elif row.status == IGNORED:
            ignored.append(shown)
    if problems:
        raise ConfigError(f"{source}: " + "; ".join(problems))
    return ignored


def strip_ignored(ds: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``ds`` for the ZeRO engine: without ignored keys, without refused keys that were
    accepted because harmless (offload with device 'none', a disabled profiler), and without the
    blocks the training layer consumed."""
    out = copy.deepcopy(ds)
    for path, value in list(_walk(ds)):
        row = _lookup(path) if not path.endswith(".*") else _BY_PATH[path]
        harmless_refused = row is not None and row.status == REFUSED
        if row is not None and (row.status == IGNORED or harmless_refused):
            keys = (path[:-2] if path.endswith(".*") else path).split(".")
            node = out
            for k in keys[:-1]:
                node = node.get(k, {})
            node.pop(keys[-1], None)
    if "zero_optimization" in out and not out["zero_optimization"]:
        out.pop("zero_optimization")
    # Consumed by the training layer when the command line was resolved (LR schedule, monitors,
    # recompute, log interval); the engine has no use for them.
    for block in ("scheduler", "tensorboard", "csv_monitor", "wandb", "activation_checkpointing", "steps_per_print",
                  "memory_breakdown"):
        out.pop(block, None)
    return out
