"""TrainConfig: the typed, validated description of one training run.

Built by ``megazero.config.arguments.parse_args`` from a Megatron-style command
line (plus an optional DeepSpeed JSON); consumed by the training loop. Every value
here is *resolved*: no ``None`` means "work it out later" except where documented
(e.g. ``checkpoint.save is None`` means "do not save"). The LR schedule is stored
in samples, as Megatron does, so it stays correct however the batch is split.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch

from megazero.config.ds_keys import strip_ignored
from megazero.config.errors import ConfigError  # re-exported: `from megazero.config.train_config import ConfigError`
from megazero.model.config import GPTConfig
from megazero.zero.config import (
    FP16Config,
    ZeroConfig,
    parse_communication_data_type,
    parse_fp16,
    parse_grad_accum_dtype,
    parse_zero_optimization,
)
from megazero.zero.optimizers import component

__all__ = [
    "ConfigError",
    "ParallelConfig",
    "PrecisionConfig",
    "OptimConfig",
    "ScheduleConfig",
    "DataConfig",
    "CheckpointConfig",
    "LoggingConfig",
    "GenerateConfig",
    "TrainConfig",
]


@dataclass
class ParallelConfig:
    """How the world is split: world = tp x cp x pp x dp."""

    tp: int = 1  # tensor-model-parallel size
    pp: int = 1  # pipeline-model-parallel size
    virtual_pp: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    decoder_first_pipeline_num_layers: Optional[int] = None  # uneven split: layers of the first stage
    decoder_last_pipeline_num_layers: Optional[int] = None  # uneven split: layers of the last stage
    dp: int = 1  # data-parallel size = world_size // (tp * cp * pp): ranks that read different samples
    cp: int = 1  # context-parallel size: ranks that split one sequence; ZeRO partitions over dp x cp
    # p2p (ring) | a2a (Ulysses) | allgather | a2a+p2p (hierarchical); or a tuple of them, one per layer
    cp_comm_type: Union[str, tuple[str, ...]] = "p2p"
    hierarchical_cp: tuple[int, ...] = ()  # a2a+p2p: (all-to-all size, ring size), product cp
    ep: int = 1  # expert-parallel size: ranks holding different experts of each MoE layer
    etp: Optional[int] = None  # expert tensor-parallel size: ranks sharing one expert's weights (None: tp)

    def __post_init__(self) -> None:
        if self.etp is None:
            self.etp = self.tp

    @property
    def cp_comm_types(self) -> tuple[str, ...]:
        """The exchanges in use, each once, in order of first use."""
        kinds = (self.cp_comm_type,) if isinstance(self.cp_comm_type, str) else self.cp_comm_type
        return tuple(dict.fromkeys(kinds))
    world_size: int = 1
    zero_stage: int = 1  # 0: plain DP, 1: optimizer states, 2: + grads, 3: + params partitioned
    sequence_parallel: bool = False  # Megatron 2022 SP (needs tp > 1)
    distributed_backend: Optional[str] = None  # None: nccl on CUDA, gloo otherwise
    # every process group's collective timeout, and how long a rank may make no progress before the
    # run ends naming it (megazero.training.watchdog); Megatron's --distributed-timeout-minutes
    distributed_timeout_minutes: float = 10.0
    local_rank: Optional[int] = None  # --local_rank as the launcher passed it (LOCAL_RANK is what is read)


@dataclass
class PrecisionConfig:
    """Training precision and (fp16 only) the loss-scaler settings."""

    dtype: str = "fp32"  # 'bf16' | 'fp16' | 'fp32'
    loss_scale: Optional[float] = None  # fp16 static loss scale; None -> dynamic
    initial_loss_scale: float = 2.0 ** 32  # dynamic scaler start (Megatron's default; DeepSpeed's JSON: 2**16)
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000  # good steps before the dynamic scale is raised
    hysteresis: int = 2  # overflows tolerated before the scale is lowered
    consecutive_hysteresis: bool = False  # DeepSpeed's fp16.consecutive_hysteresis
    accumulate_grads_fp32: bool = False  # --accumulate-allreduce-grads-in-fp32
    grad_accum_dtype: Optional[str] = None  # --main-grads-dtype & co. (None: the JSON's, else the engine's default)
    grad_comm_dtype: Optional[str] = None  # --megatron-fsdp-grad-comm-dtype (None: the JSON's, else the accumulation's)

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype of the model's compute weights/activations."""
        return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[self.dtype]

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.dtype == "fp16" and self.loss_scale is None


@dataclass
class OptimConfig:
    """Optimizer hyper-parameters. ``lr`` is the peak LR the schedule warms up to."""

    type: str = "AdamW"  # a registered optimizer (megazero/zero/optimizers/); Megatron's 'adam' is AdamW
    settings: Any = None  # the optimizer's own, from its flags (its component's settings(); None: its defaults)
    # QK-clip (Kimi K2's MuonClip): after each update, scale the query/key weights of every head whose
    # largest attention logit exceeded the threshold (Megatron's --qk-clip*, --log-max-attention-logit).
    qk_clip: bool = False
    qk_clip_threshold: float = 100.0
    qk_clip_alpha: float = 0.5
    log_max_attention_logit: bool = False
    lr: float = 1e-4
    min_lr: float = 0.0
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0  # global grad-norm clip; 0 disables
    # Weight-decay schedule (Megatron): from start to end over the run; 'constant' keeps weight_decay.
    start_weight_decay: Optional[float] = None
    end_weight_decay: Optional[float] = None
    weight_decay_incr_style: str = "constant"
    # --optimizer-cpu-offload / --optimizer-offload-fraction (None: as the DeepSpeed JSON says, else none).
    offload_device: Optional[str] = None
    offload_fraction: Optional[float] = None


@dataclass
class ScheduleConfig:
    """Batch sizes, run length, LR curve (in samples) and eval/exit cadence (in iterations)."""

    micro_batch_size: int = 1  # per rank, per forward/backward
    global_batch_size: int = 1  # = micro_batch_size * dp * grad_accum_steps
    grad_accum_steps: int = 1
    train_iters: int = 0  # resolved even when --train-samples was given (floor division)
    train_samples: int = 0  # = train_iters * global_batch_size unless given explicitly
    lr_decay_style: str = "linear"  # 'constant' | 'linear' | 'cosine' | 'inverse-square-root' | 'WSD'
    # The LR schedule's unit: 'samples' (Megatron) or 'tokens' (Megatron-DeepSpeed's --lr-*-tokens).
    # lr_warmup_samples / lr_decay_samples / lr_wsd_decay_samples are counted in that unit.
    lr_unit: str = "samples"
    lr_warmup_samples: int = 0
    lr_decay_samples: int = 0  # the decay ends here (counted from sample 0, warmup included)
    lr_warmup_init: float = 0.0
    lr_wsd_decay_style: str = "exponential"
    lr_wsd_decay_samples: Optional[int] = None
    # Batch-size ramp-up (start, increment, ramp samples), Megatron's --rampup-batch-size.
    rampup_batch_size: Optional[tuple[int, int, int]] = None
    train_tokens: Optional[int] = None  # Megatron-DeepSpeed: stop once this many tokens were consumed
    eval_interval: int = 1000  # iterations between evaluations; 0 disables
    eval_iters: int = 100  # batches per evaluation
    exit_interval: Optional[int] = None  # stop (after saving) when iteration % exit_interval == 0
    exit_duration_in_mins: Optional[float] = None  # stop (after saving) after this much training time
    exit_signal_handler: bool = False  # SIGTERM -> save and exit
    # outside fp16, a non-finite loss or gradient norm ends the run with a debug checkpoint; False
    # (--no-check-for-nan-in-loss-and-grad): the step is skipped and training goes on
    check_for_nan_in_loss_and_grad: bool = True
    skip_train: bool = False  # evaluate only
    override_opt_param_scheduler: bool = False  # on resume: the command line's schedule wins
    use_checkpoint_opt_param_scheduler: bool = False  # on resume: the checkpoint's schedule wins

    @property
    def lr_warmup_iters(self) -> float:
        return self.lr_warmup_samples / self.global_batch_size

    def global_batch_size_at(self, consumed_samples: int) -> int:
        """The global batch of the iteration that starts after ``consumed_samples`` (ramp-up aware)."""
        if self.rampup_batch_size is None:
            return self.global_batch_size
        return rampup_global_batch_size(self.rampup_batch_size, self.global_batch_size, consumed_samples)


def rampup_global_batch_size(rampup: tuple[int, int, int], global_batch_size: int, consumed_samples: int) -> int:
    """Megatron's --rampup-batch-size START INCR SAMPLES: START + INCR * floor(consumed / (SAMPLES /
    ((global - START) / INCR))) until SAMPLES were consumed, then the full global batch."""
    start, incr, ramp = rampup
    if consumed_samples > ramp:
        return global_batch_size
    per_increment = ramp / ((global_batch_size - start) // incr)
    return min(global_batch_size, start + int(consumed_samples / per_increment) * incr)


@dataclass
class DataConfig:
    """Where tokens come from. With ``mock_data`` there are no files (synthetic ids)."""

    data_path: list[str] = field(default_factory=list)  # raw Megatron form: "[w1] p1 [w2] p2 ..."
    prefixes: list[str] = field(default_factory=list)  # parsed: dataset prefixes ({p}.bin/{p}.idx)
    # parsed: normalised blend weights; None without weights (one prefix, or 'P1 P2 ...': megatron-core
    # blends unweighted prefixes in proportion to their sizes)
    weights: Optional[list[float]] = None
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: Optional[str] = None  # None only with mock data
    tokenizer_model: Optional[str] = None
    vocab_file: Optional[str] = None
    merge_file: Optional[str] = None
    vocab_size: Optional[int] = None  # the --vocab-size flag as given (NullTokenizer's argument)
    # Separate split files (Megatron's --train/valid/test-data-path), each like data_path.
    train_data_path: list[str] = field(default_factory=list)
    valid_data_path: list[str] = field(default_factory=list)
    test_data_path: list[str] = field(default_factory=list)
    data_cache_path: Optional[str] = None
    num_workers: int = 0  # DataLoader workers (Megatron defaults to 2; 0 reads in the training process)
    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    eod_mask_loss: bool = False
    vocab_extra_ids: int = 0

    def tokenizer_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``megazero.data.build_tokenizer(self.tokenizer_type, **kw)``."""
        return dict(tokenizer_model=self.tokenizer_model, vocab_file=self.vocab_file,
                    merge_file=self.merge_file, vocab_size=self.vocab_size, vocab_extra_ids=self.vocab_extra_ids)


@dataclass
class CheckpointConfig:
    save: Optional[str] = None  # directory to save to; None -> never save
    load: Optional[str] = None  # directory to resume from; None -> start fresh
    save_interval: Optional[int] = None  # iterations between saves (needs save)
    pretrained: Optional[str] = None  # full weights to start from (model_full.safetensors + config.json)
    finetune: bool = False  # load weights only; iteration/samples/optimizer/RNG start afresh
    no_load_optim: bool = False
    no_load_rng: bool = False
    ckpt_step: Optional[int] = None  # --ckpt-step: load this iteration instead of the latest
    use_checkpoint_args: bool = False
    ckpt_format: str = "megazero"  # what --save writes: "megazero" or "torch_dist" (Megatron-LM's)
    # the layer spec whose names a torch_dist save uses where megatron-core's specs differ (--transformer-impl)
    transformer_impl: str = "transformer_engine"
    async_save: bool = False  # write checkpoints in the background (one in flight)


@dataclass
class LoggingConfig:
    log_interval: int = 100  # iterations between log lines / metrics records
    tensorboard_dir: Optional[str] = None
    metrics_file: Optional[str] = None  # JSONL; defaults to {save}/metrics.jsonl when --save is given
    wall_clock_breakdown: bool = False  # per-phase timers (DeepSpeed's key)
    tensorboard_log_interval: int = 1
    tensorboard_queue_size: int = 1000
    log_timers_to_tensorboard: bool = False
    log_batch_size_to_tensorboard: bool = False
    log_validation_ppl_to_tensorboard: bool = False
    log_memory_to_tensorboard: bool = False
    log_optimizer_states_to_tensorboard: bool = False
    log_params_norm: bool = False
    log_num_zeros_in_grad: bool = False
    log_throughput: bool = False
    csv_dir: Optional[str] = None  # DeepSpeed csv_monitor: one CSV per metric
    wandb_project: Optional[str] = None
    wandb_exp_name: Optional[str] = None
    wandb_save_dir: Optional[str] = None
    # CPU: track live tensor storages (megazero.utils.LiveMemoryTracker) so the log line's memory is the
    # interval's peak; about 4x per op, hence off by default. CUDA reports its allocator's peak anyway.
    track_memory: bool = False
    # one device's dense peak TFLOP/s for the log line's MFU (None: known CUDA GPUs' bf16 peak, else no MFU)
    device_peak_tflops: Optional[float] = None
    # --log-straggler: every log interval, the slowest and fastest ranks' phase times (one small gather)
    log_straggler: bool = False
    straggler_minmax_count: int = 1  # how many slowest and fastest ranks the line names
    straggler_factor: float = 1.5  # a rank this much slower than the median, interval after interval, is warned of


@dataclass
class GenerateConfig:
    """Optional greedy sample printed at the end of training."""

    prompt: Optional[str] = None
    tokens: int = 32


@dataclass
class TrainConfig:
    """Everything one run needs, resolved and validated (see ``parse_args``)."""

    model: GPTConfig
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    seed: int = 1234
    # The --deepspeed-config JSON as loaded (None when not given). Its keys that the
    # command line does not own (bucket sizes, stage-3 and offload knobs, ...) reach the
    # engine through zero_config() as the JSON wrote them.
    deepspeed_json: Optional[dict[str, Any]] = None
    # One line each, printed by rank 0 at start-up: what a flag or JSON key was mapped to
    # or superseded by, and the DeepSpeed-internal JSON keys that were ignored.
    notes: list[str] = field(default_factory=list)

    @property
    def tokens_per_iteration(self) -> int:
        return self.schedule.global_batch_size * self.model.seq_length

    def zero_config(self) -> ZeroConfig:
        """The ZeRO engine's configuration, for ``megazero.zero.initialize(model, cfg.zero_config(), ...)``.

        The values the command line owns (batch split, optimizer, precision and loss scaler,
        stage, offload device and fraction, clipping) come from this config field by field; the
        engine knobs only the --deepspeed-config JSON sets (bucket sizes, stage-3 and offload keys,
        adam_w_mode, the reduction's dtype) from the JSON's blocks, parsed by megazero.zero.config.
        ``optimizer.lr`` is the peak LR; the LR schedule sets the per-step value. Raises
        ``ZeroConfigError`` on settings the engine refuses (offload at stage 0, ...).
        """
        ds = strip_ignored(self.deepspeed_json) if self.deepspeed_json else {}
        s, o, p = self.schedule, self.optim, self.precision
        optimizer = component(o.type).engine_config(o, ds.get("optimizer", {}).get("params", {}))
        zero = parse_zero_optimization(ds.get("zero_optimization", {}))
        offload = zero.offload_optimizer
        if o.offload_device is not None:
            offload = dataclasses.replace(offload, device=str(o.offload_device).lower())
            if o.offload_fraction is not None:
                offload = dataclasses.replace(offload, ratio=float(o.offload_fraction))
        zero = dataclasses.replace(zero, stage=self.parallel.zero_stage, offload_optimizer=offload)
        fp16 = None
        if p.dtype == "fp16":
            json_fp16 = parse_fp16(ds.get("fp16", {}))
            fp16 = FP16Config(
                loss_scale=p.loss_scale if p.loss_scale is not None else 0.0,  # DeepSpeed: 0 = dynamic
                initial_scale_power=int(round(math.log2(p.initial_loss_scale))),
                loss_scale_window=p.loss_scale_window, hysteresis=p.hysteresis, min_loss_scale=p.min_loss_scale,
                consecutive_hysteresis=p.consecutive_hysteresis or json_fp16.consecutive_hysteresis)
        grad_accum = parse_grad_accum_dtype(ds.get("data_types", {}).get("grad_accum_dtype"))
        return ZeroConfig(
            train_micro_batch_size_per_gpu=s.micro_batch_size,
            gradient_accumulation_steps=s.grad_accum_steps,
            train_batch_size=s.global_batch_size,
            optimizer=optimizer,
            zero_optimization=zero,
            bf16=p.dtype == "bf16",
            fp16=fp16,
            gradient_clipping=float(o.clip_grad),
            grad_accum_dtype="fp32" if p.accumulate_grads_fp32 else p.grad_accum_dtype or grad_accum,
            steps_per_print=self.logging.log_interval,
            wall_clock_breakdown=self.logging.wall_clock_breakdown,
            communication_data_type=p.grad_comm_dtype or parse_communication_data_type(ds.get("communication_data_type")),
            prescale_gradients=bool(ds.get("prescale_gradients", False)),
            gradient_predivide_factor=float(ds.get("gradient_predivide_factor", 1.0)),
        ).validate()

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly nested dict (for logging the resolved config and for checkpoints)."""
        out: dict[str, Any] = {"model": self.model.to_dict()}
        for f in dataclasses.fields(self):
            if f.name == "model":
                continue
            value = getattr(self, f.name)
            out[f.name] = dataclasses.asdict(value) if dataclasses.is_dataclass(value) else copy.deepcopy(value)
        return out
