"""The flag table's rows for Megatron-LM's newer flags that belong to megazero's own groups: pipeline splits,
Megatron-FSDP as ZeRO, the precision-aware optimizer's dtypes, checkpoint and data options, and the kernel,
fusion and communication choices megazero accepts. ``flags`` calls each ``add_*`` inside its group; each
``g(status, names, meaning, type, **kw)`` adds one row (see ``flags.Flag``), ``refuse`` a set of refused rows.

Accepted with no effect ("...; accepted") are only the flags that choose how Megatron computes or communicates
something megazero computes too, with the same result (a fused kernel, a bucket size, when a stage launches its
reductions), and switches that turn off something megazero does not do. A flag that turns on a capability
megazero lacks (a memory saving, an overlap, a different loss or model) is refused, naming the megazero way."""

from __future__ import annotations

import argparse
from typing import Any, Callable

from megazero.config.flag_rows import _layer_freq, accept, refuse

__all__ = ["add_parallel_rows", "add_model_rows", "add_moe_rows_newer", "add_recompute_rows", "add_schedule_rows",
           "add_precision_rows", "add_data_rows", "add_checkpoint_rows", "add_logging_rows",
           "add_mtp_rows_newer"]

H, M, R = "honoured", "mapped", "refused"
G = Callable[..., Any]
_GRAD_DTYPE = ("gradient accumulation and reduction dtype (the DeepSpeed JSON's data_types.grad_accum_dtype); "
               "default fp32 under --bf16, as Megatron's main_grad")


def add_parallel_rows(g: G) -> None:
    """Group "launcher and parallelism"."""
    for which, stage in (("embedding", "first"), ("loss", "last")):
        g(H, f"--account-for-{which}-in-pipeline-split", f"the {which} counts as one layer when the layers are split "
          f"over the pipeline stages: the {stage} stage holds one layer fewer than the others, (num_layers + "
          "accounted) / pp each (Megatron-core's split; without virtual stages, whose chunks megazero splits evenly, "
          f"and without --decoder-{stage}-pipeline-num-layers, as Megatron asserts)")
    g(H, "--microbatch-group-size-per-virtual-pipeline-stage", "micro-batches run together per model chunk by "
      "interleaved 1F1B: megazero's schedule groups them by pp, Megatron's default; another size is refused", int)
    g(M, "--no-overlap-p2p-communication", "pipeline sends and receives not overlapped with compute: megazero posts "
      "each exchange as one batch (batch_isend_irecv) and waits for it, which is this; accepted")
    refuse(g, "overlapping the pipeline's exchanges with compute does not exist in megazero: each exchange is posted "
           "as one batch and waited for; drop the flag", "--overlap-p2p-communication-warmup-flush")
    refuse(g, "megazero's pipeline uses torch.distributed's batch_isend_irecv; a custom ring_exchange build is not "
           "used; drop the flag", "--use-ring-exchange-p2p")
    refuse(g, "the pipeline's messages go over the groups of --distributed-backend (nccl on GPUs, gloo on CPUs); "
           "drop the flag", values="--pipeline-model-parallel-comm-backend")
    refuse(g, "megazero's rank order is tp-cp-dp-pp (Megatron's default: rank = ((pp_rank x dp + dp_rank) x cp + "
           "cp_rank) x tp + tp_rank); the tp-cp-ep-pp-dp order does not exist; drop the flag", "--use-tp-pp-dp-mapping")
    refuse(g, "Megatron's old name, which Megatron-LM refuses too: use --tensor-model-parallel-size",
           values="--model-parallel-size")
    refuse(g, "generalized tensor parallelism (weights sharded beyond the tensor-parallel group and rematerialized) "
           "does not exist in megazero: shard the weights over data parallel with --zero-stage 3; drop the flag",
           "--gtp-remat-reduce-scatter-with-fp32-accumulation --gtp-remat-nccl-ub --gtp-expert-remat-nccl-ub",
           "--tensor-parallel-num-weight-shards --expert-tensor-parallel-num-weight-shards --gtp-remat-opt-in-modules")
    refuse(g, "hybrid context parallelism (sequences of varied length balanced over data x context ranks) does not "
           "exist in megazero: --context-parallel-size splits every sequence over its ranks; drop the flag",
           "--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank")
    refuse(g, "overlapping the experts' all-to-all with another micro-batch's computation (with the weight gradients "
           "it delays) does not exist in megazero yet; drop the flag", "--overlap-moe-expert-parallel-comm "
           "--delay-wgrad-compute --overlap-dispatch-backward-with-experts-wgrad "
           "--ep-overlap-early-attn-memory-release --high-priority-a2a-comm-stream")
    refuse(g, "deferring the embedding's weight gradient into the pipeline flush does not exist in megazero; drop "
           "the flag", "--defer-embedding-wgrad-compute", "--wgrad-deferral-limit")
    _data_parallel_rows(g)
    _fsdp_rows(g)
    _process_group_rows(g)


def _data_parallel_rows(g: G) -> None:
    accept(g, "the size (or number) of the buckets Megatron's data parallel reduces gradients in, a communication "
           "granularity: megazero's ZeRO reduces unit by unit, in buckets of the DeepSpeed JSON's "
           "zero_optimization.reduce_bucket_size; accepted", values="--ddp-bucket-size --ddp-num-buckets", type=int)
    accept(g, "padding Megatron's buckets for NCCL bandwidth; averaging inside the collective instead of dividing "
           "around it (the same average): communication details of megazero's own reduction; accepted",
           "--ddp-pad-buckets-for-high-nccl-busbw --ddp-average-in-collective")
    g(M, "--overlap-param-gather-with-optimizer-step", "overlap the first parameter all-gather with the optimizer "
      "step: megazero's post-step all-gather runs after the step (a speed difference only); accepted")
    g(M, ("--no-align-grad-reduce", "--disable-align-grad-reduce"), "each pipeline stage launches its gradient "
      "reductions as its backward ends, not all stages at once: what megazero's stages do; accepted",
      dest="no_align_grad_reduce")
    g(M, "--no-align-param-gather", "each pipeline stage launches its parameter all-gathers as it needs them, not "
      "all stages at once: what megazero's stages do; accepted")
    refuse(g, "sending gradients in a lower precision while summing them in fp32 does not exist in megazero: a "
           "reduction sums in the dtype it sends (--megatron-fsdp-grad-comm-dtype, default the accumulation "
           "dtype); drop the flag", "--ddp-reduce-scatter-with-fp32-accumulation")
    refuse(g, "a per-parameter gradient accumulation dtype does not exist in megazero: every gradient accumulates in "
           f"one, the {_GRAD_DTYPE} (--main-grads-dtype); drop the flag",
           values="--ddp-param-name-patterns-for-fp32-local-accumulation")


def _fsdp_rows(g: G) -> None:
    g(M, ("--use-megatron-fsdp", "--use-torch-fsdp2"), "fully sharded data parallel (parameters, gradients and "
      "optimizer states over data parallel) is ZeRO stage 3: sets --zero-stage 3 unless "
      "--data-parallel-sharding-strategy or --zero-stage gives the stage; gradients accumulate in the "
      f"{_GRAD_DTYPE} (Megatron-FSDP's auto: the compute dtype; --megatron-fsdp-main-grads-dtype bf16 for that)")
    g(M, "--data-parallel-sharding-strategy", "Megatron-FSDP's sharding: no_shard, optim, optim_grads and "
      "optim_grads_params are ZeRO stages 0, 1, 2 and 3 (with --use-megatron-fsdp or --use-torch-fsdp2; a "
      "--zero-stage that disagrees is refused)", str, choices=("no_shard", "optim", "optim_grads",
                                                              "optim_grads_params"))
    g(H, "--outer-dp-sharding-strategy", "sharding over the outer data-parallel group of hybrid sharding (HSDP): "
      "megazero shards over the whole data-parallel group, which is no_shard outside; optim is refused", str,
      only=("no_shard",))
    g(H, "--num-distributed-optimizer-instances", "copies of the distributed optimizer across data parallel "
      "(partial sharding): megazero shards over the whole data-parallel group, one instance; more are refused",
      int, only=(1,))
    refuse(g, "hybrid sharded data parallel (HSDP) does not exist in megazero: ZeRO shards over the whole "
           "data-parallel group; drop the flag", "--enable-full-sharding-in-hsdp")
    refuse(g, "megazero's ZeRO-3 frees each unit's gathered parameters after its forward; to keep parameters whole "
           "between forward and backward use --zero-stage 2; drop the flag", "--torch-fsdp2-no-reshard-after-forward")
    g(H, "--megatron-fsdp-main-params-dtype", "the master weights of Megatron-FSDP: megazero keeps them in fp32; "
      "another dtype (auto: the compute dtype) is refused", str, only=("fp32",))
    g(H, "--megatron-fsdp-main-grads-dtype", "Megatron-FSDP's gradient buffer: fp32, bf16 or fp16 set the "
      f"{_GRAD_DTYPE}, as --main-grads-dtype; auto leaves it", str, choices=("fp32", "bf16", "fp16", "auto"))
    g(H, "--megatron-fsdp-grad-comm-dtype", "the dtype gradients are reduced in (the DeepSpeed JSON's "
      "communication_data_type): fp32, bf16 or fp16; auto: the accumulation dtype", str,
      choices=("fp32", "fp16", "bf16", "auto"))
    g(M, "--init-model-with-meta-device", "build the model on the meta device: megazero always does, and "
      "materializes each rank's partition; accepted")
    accept(g, "Megatron-FSDP's implementation, buffer allocation and communication sizes: megazero's ZeRO-3 has its "
           "own (the DeepSpeed JSON's stage3_prefetch_bucket_size and stage3_max_live_parameters); accepted",
           "--fsdp-double-buffer --megatron-fsdp-max-pool-double-buffer --fsdp-db-use-persist-buf-on-alloc-fail "
           "--megatron-fsdp-enable-fine-grained-param-gather", "--megatron-fsdp-version "
           "--suggested-communication-unit-size")


def _process_group_rows(g: G) -> None:
    g(M, "--disable-gloo-process-groups", "Megatron's side Gloo groups: megazero makes none beside the backend's, "
      "except --async-save's one for agreeing on finished saves; accepted")
    g(M, "--disable-jit-fuser", "megazero uses no TorchScript JIT fusion; accepted")
    accept(g, "turn off a part of NCCL user-buffer registration or of PyTorch's flight recorder, which megazero does "
           "not set up; accepted", "--disable-symmetric-registration --no-flight-recorder-dump-on-timeout "
           "--disable-flight-recorder-dump-on-timeout --no-flight-recorder-include-only-active "
           "--disable-flight-recorder-include-only-active --no-flight-recorder-extra-dump-on-exec "
           "--disable-flight-recorder-extra-dump-on-exec")
    refuse(g, "registering NCCL user buffers (or a second group for all-gathers) does not exist in megazero; drop "
           "the flag", "--use-nccl-ub --fsdp-manual-registration --create-all-gather-group")
    refuse(g, "megazero does not set up SHARP for its groups (NCCL's environment, NCCL_COLLNET_ENABLE, does); drop "
           "the flag", "--use-sharp", "--sharp-enabled-group")
    refuse(g, "per-communicator NCCL settings (a configuration file, high-priority streams) are not applied by "
           "megazero: NCCL's environment variables apply to every group; drop the flag", "",
           "--nccl-communicator-config-path --high-priority-stream-groups")
    refuse(g, "megazero has one collective timeout for the whole run, --distributed-timeout-minutes; drop the flag",
           values="--distributed-timeout-seconds-after-init")
    refuse(g, "megazero does not configure PyTorch's NCCL flight recorder: set its environment variables "
           "(TORCH_NCCL_TRACE_BUFFER_SIZE, TORCH_FR_DUMP_TEMP_FILE, TORCH_INCLUDE_STACK_TRACE) in the launch "
           "environment and drop the flag", "--flight-recorder-include-stack-trace",
           "--flight-recorder-dump-path --flight-recorder-trace-buffer-size")
    refuse(g, "deferring the process groups' setup is a Python API of Megatron (initialize_megatron), not a launch "
           "option: megazero starts its groups once per run; drop the flag", "--lazy-mpu-init")
    refuse(g, "a training run on fake process groups does not exist in megazero: tools/rehearse.py runs any rank of "
           "any world size on fake groups and the meta device; drop the flag", "--fake-process-group")


def _window_size(s: str) -> tuple[int, ...]:
    """``--window-size``: Megatron's tuple, ``LEFT,RIGHT`` (parentheses allowed)."""
    parts = s.strip().strip("()").split(",")
    try:
        return tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: give the window as LEFT,RIGHT, e.g. 127,0") from None


def add_model_rows(g: G) -> None:
    """Group "model": the layers' newer options."""
    g(M, "--no-initialization", "skip initializing the weights (they come from --load): megazero initializes every "
      "run (on the meta device, each rank its partition) and --load overwrites them; accepted")
    g(H, "--softmax-type", "the attention softmax: vanilla; off-by-one (a zero logit joins every softmax) or learnable "
      "(attention sinks: one learned logit per head joins every softmax, gpt-oss's; megatron-core's "
      "core_attention.softmax_offset). Exact under every --context-parallel-size and --cp-comm-type", str,
      choices=("vanilla", "off-by-one", "learnable"))
    g(H, "--quick-geglu", "quick GEGLU MLP (gpt-oss's): x1 * sigmoid(1.702 x1) * x2, fc1 [x1; x2] as --swiglu's; "
      "the FFN size stays 4h without --ffn-hidden-size, as Megatron")
    g(H, "--glu-linear-offset", "an offset in a gated MLP (--swiglu or --quick-geglu), act(x1) * (x2 + offset) "
      "(gpt-oss: 1)", float, default=0.0)
    g(H, "--activation-func-clamp-value", "clamp a gated MLP's fc1 output (--swiglu or --quick-geglu) before its "
      "activation: x1 to at most the value, x2 to within +- the value (gpt-oss: 7), in the dense MLPs, routed and "
      "shared experts alike", float)
    accept(g, "a fused or Transformer Engine kernel (weighted squared ReLU, residual + RMSNorm, TE's op fuser and "
           "activations, grouped GEMMs for the dense and shared-expert MLPs): megazero computes these steps with "
           "PyTorch ops, the same function; accepted", "--use-fused-weighted-squared-relu --fused-residual-rmsnorm "
           "--use-transformer-engine-op-fuser --use-te-activation-func --use-grouped-gemm-for-dense-mlp "
           "--use-grouped-gemm-for-shared-expert")
    accept(g, "the FlashAttention generation: megazero's --attention-backend flash uses the installed flash-attn; "
           "accepted", values="--flash-attention-version")
    accept(g, "clone the embedding's scattered output for garbage collection, a memory detail of Megatron's "
           "sequence parallelism; accepted", "--no-clone-scatter-output-in-embedding "
           "--disable-clone-scatter-output-in-embedding")
    refuse(g, "megazero's layers are pre-norm (GPT); the residual taken after the norm (original BERT) does not "
           "exist; drop the flag", "--apply-residual-connection-post-layernorm")
    refuse(g, "megazero's RoPE rotates the first and second halves of each head (Megatron's default, Llama's); the "
           "interleaved pairing (RoFormer) does not exist; drop the flag", "--rotary-interleaved")
    refuse(g, "Llama 4's L2 normalization of queries and keys does not exist in megazero (--qk-layernorm normalizes "
           "them with --normalization); drop the flag", "--qk-l2-norm")
    refuse(g, "megazero's loss is Megatron's default: the mean over each micro-batch's loss-mask tokens, averaged "
           "over micro-batches and data-parallel ranks; dividing the global batch's summed loss by its number of "
           "tokens does not exist yet (the two agree when every micro-batch has as many loss tokens, i.e. without "
           "--eod-mask-loss); drop the flag", "--calculate-per-token-loss")
    refuse(g, "a separate standard deviation for the embedding does not exist in megazero yet: every weight starts "
           "from N(0, --init-method-std); drop the flag", values="--embedding-init-method-std")
    refuse(g, "the maximal update parametrization (MuP) does not exist in megazero yet: its initialization and "
           "learning rates are the standard parametrization's; drop the flag", "--use-mup",
           "--mup-width-mult --mup-base-hidden-size --mup-embedding-mult --mup-output-mult --mup-base-head-dim "
           "--mup-attn-scale-power")
    refuse(g, "a deterministic-kernels mode (deterministic NCCL algorithms and attention backward) does not exist in "
           "megazero; drop the flag", "--deterministic-mode")
    g(H, "--use-rope-scaling", "Llama 3.1's RoPE frequency scaling (rope_type llama3): wavelengths beyond the "
      "original context of 8192 are stretched by --rope-scaling-factor, those under 8192/4 kept, the ones between "
      "blended (Megatron-core's low and high frequency factors 1 and 4)")
    g(H, "--rope-scaling-factor", "the context extension of --use-rope-scaling", float, default=8.0)
    refuse(g, "RoPE position interpolation and RoPE-free layers do not exist in megazero (Llama 3's scaling does: "
           "--use-rope-scaling; YaRN: --position-embedding-type yarn); drop the flag",
           values="--rotary-seq-len-interpolation-factor --no-rope-freq --mrope-section")
    g(H, "--window-size", "sliding-window attention as LEFT,RIGHT (Transformer Engine's convention): a query at i sees "
      "the keys i-LEFT .. i; a GPT is causal, so RIGHT is 0 (HF's sliding_window W is W-1,0). Only the blocks the "
      "window reaches are computed, in every attention backend and --cp-comm-type", _window_size)
    g(H, "--window-attn-skip-freq", "which layers slide under --window-size: N, every layer but each N-th (1-based) "
      "one, which attends over its whole context (gpt-oss: 2); or a pattern of one 1 (sliding) or 0 (global) per "
      "layer such as \"([1]*3+[0])*4\". Default: every layer slides", _layer_freq)
    refuse(g, "megazero's GELU is the exact one (Megatron's default); OpenAI's GELU does not exist; drop the flag",
           "--openai-gelu")
    refuse(g, "megazero trains GPTs (decoder only): encoder-decoder and BERT settings do not exist; a GPT's depth "
           "is --num-layers and its context --seq-length", "--bert-no-binary-head",
           "--encoder-num-layers --decoder-num-layers --decoder-seq-length --relative-attention-num-buckets "
           "--relative-attention-max-distance")
    refuse(g, "megazero does not export to ONNX; drop the flag", values="--onnx-safe")
    refuse(g, "heterogeneous layers (a shape per layer, Llama-Nemotron) do not exist in megazero: every layer comes "
           "from the flags; drop the flag", "",
           "--heterogeneous-layers-config-path --heterogeneous-layers-config-encoded-json")
    refuse(g, "manifold-constrained hyper-connections (mHC) do not exist in megazero yet: each layer has one residual "
           "stream; drop the flag", "--enable-mhc-connections", "--mhc-num-residual-streams --mhc-sinkhorn-iterations "
           "--mhc-init-gating-factor --mhc-recompute-layer-num")
    refuse(g, "batch-invariant kernels do not exist in megazero; drop the flag", "--batch-invariant-mode",
           "--batch-invariant-backend")
    refuse(g, "megazero prints its resolved run at start-up; dumping Megatron's config objects does not exist; drop "
           "the flag", values="--config-logger-dir")
    refuse(g, "splitting the MLP's sequence into chunks does not exist in megazero; drop the flag",
           values="--mlp-chunks-for-training")


def add_moe_rows_newer(g: G) -> None:
    """Group "model": Megatron-core's newer mixture-of-experts options."""
    accept(g, "Transformer Engine's GroupedTensor storage and path for the experts' grouped matmuls: megazero's "
           "--moe-grouped-gemm uses torch._grouped_mm (the same function); accepted", "--moe-use-grouped-tensor "
           "--moe-single-grouped-weight --moe-single-grouped-bias")
    refuse(g, "running the shared expert beside the token dispatch does not exist in megazero: it runs before the "
           "router (the same result, not overlapped); drop the flag", "--moe-shared-expert-overlap")
    refuse(g, "the block-interleaved layout of the GLU weights does not exist in megazero: its first projection holds "
           "the gate, then the up projection; drop the flag",
           values="--moe-shared-expert-glu-interleave-size --moe-mlp-glu-interleave-size")
    refuse(g, "weighting the experts' inputs by the routing probabilities does not exist in megazero yet: it weighs "
           "their outputs (Megatron's default); drop the flag", "--moe-apply-probs-on-input")
    refuse(g, "latent projections around the experts (latent MoE) do not exist in megazero yet; drop the flag",
           values="--moe-latent-size")
    refuse(g, "replaying recorded routing decisions, random router biases and input jitter do not exist in megazero; "
           "drop the flag", "--moe-enable-routing-replay", "--moe-router-force-biased --moe-input-jitter-eps "
           "--moe-router-quantile-balancing-ema")
    refuse(g, "the flex dispatcher (DeepEP, HybridEP, NCCL EP) and its tuning do not exist in megazero; use "
           "--moe-token-dispatcher-type alltoall and drop the flag", "--moe-enable-deepep "
           "--moe-permute-fusion-into-hybridep --moe-hybridep-pad-uneven-dispatch-inputs --moe-ncclep-zero-copy",
           "--moe-flex-dispatcher-num-sms --moe-deepep-num-sms --moe-hybridep-num-sms "
           "--moe-hybridep-num-blocks-permute "
           "--moe-hybridep-num-blocks-unpermute --moe-hybridep-num-sms-preprocessing --moe-dispatch-fwd-dtype "
           "--moe-combine-bwd-dtype --moe-expert-rank-capacity-factor")
    refuse(g, "paged stashing of the experts' activations does not exist in megazero; recompute them with "
           "--recompute-granularity full and drop the flag", "--moe-paged-stash", "--moe-paged-stash-page-size "
           "--moe-paged-stash-buffer-size-factor-cuda --moe-paged-stash-buffer-size-factor-cpu")
    refuse(g, "upcycling a dense checkpoint into experts does not exist in megazero; drop the flag",
           "--moe-use-upcycling", "--moe-upcycling-granularity")
    refuse(g, "per-layer logging of the auxiliary and z losses does not exist in megazero; drop the flag",
           "--moe-per-layer-logging")


def add_recompute_rows(g: G) -> None:
    """Group "activation recompute"."""
    refuse(g, "distributing the recomputed layers' saved inputs over the tensor-parallel ranks does not exist in "
           "megazero; use --sequence-parallel, which shards activations over the tensor-parallel group",
           "--distribute-saved-activations")
    refuse(g, "recomputing the MoE layer alone does not exist in megazero (selective recompute covers core_attn); "
           "use --recompute-granularity full", "--moe-layer-recompute")
    refuse(g, "offloading activations to the host does not exist in megazero yet; recompute them instead "
           "(--recompute-granularity) and drop the flag", "--cpu-offloading-retain-pinned-cpu-buffers "
           "--fine-grained-activation-offloading --delay-offload-until-cuda-graph",
           "--cpu-offloading-num-layers --offload-modules --min-offloaded-tensor-size "
           "--delta-offload-bytes-across-pp-ranks --activation-offload-fraction "
           "--fine-grained-offloading-max-inflight-offloads")


def add_schedule_rows(g: G) -> None:
    """Group "batch and schedule"."""
    refuse(g, "Megatron's old name, which Megatron-LM refuses too: use --micro-batch-size", values="--batch-size")
    refuse(g, "Megatron's old warmup flag, which Megatron-LM refuses too: use --lr-warmup-fraction, "
           "--lr-warmup-iters or --lr-warmup-samples", values="--warmup")
    refuse(g, "a step-wise batch-size schedule (or one lowered to fit the ranks) does not exist in megazero: "
           "--rampup-batch-size grows the batch linearly, and a global batch that micro-batch x data parallel does "
           "not divide is refused with the numbers; drop the flag", "--decrease-batch-size-if-needed",
           "--step-batch-size-schedule --phase-transition-iterations")
    refuse(g, "skipping chosen iterations does not exist in megazero; drop the flag", values="--iterations-to-skip")
    refuse(g, "a separate learning rate for the embedding and output layer does not exist in megazero yet; drop the "
           "flag", values="--decoupled-lr --decoupled-min-lr")
    refuse(g, "freezing every layer does not exist in megazero; drop the flag", "--freeze-all-layers")


def add_precision_rows(g: G) -> None:
    """Group "optimizer and precision"."""
    g(M, "--use-precision-aware-optimizer", "Megatron's optimizer keeping the master weights, gradients and Adam "
      "moments in the dtypes of --main-params-dtype, --main-grads-dtype, --exp-avg-dtype and --exp-avg-sq-dtype "
      "(Megatron needs it for --optimizer-cpu-offload): megazero's optimizer keeps masters and moments in fp32, "
      "those flags' defaults; accepted")
    g(H, "--main-grads-dtype", f"the {_GRAD_DTYPE}; bf16 accumulates and reduces in bf16", str,
      choices=("fp32", "bf16"))
    g(H, "--grad-reduce-in-bf16", "accumulate and reduce gradients in bf16 (--main-grads-dtype bf16)")
    for flag, what, megatron in (("--main-params-dtype", "the master weights", ("fp32", "fp16")),
                                 ("--exp-avg-dtype", "Adam's first moment", ("fp32", "fp16", "bf16", "fp8")),
                                 ("--exp-avg-sq-dtype", "Adam's second moment", ("fp32", "fp16", "bf16", "fp8"))):
        g(H, flag, f"the dtype of {what}: megazero keeps it in fp32 (Megatron's default); a lower precision does "
          "not exist in megazero yet", str, choices=megatron, only=("fp32",))
    g(H, "--muon-coefficient-type", "Muon's Newton-Schulz coefficients: quintic (3.4445, -4.775, 2.0315), the ones "
      "megazero has", str, only=("quintic",))
    accept(g, "Muon's kernels and buffer layout (a Triton SYRK for the Gram matrix, Megatron's layer-wise parameter "
           "layout): megazero's Muon computes the same update its own way; accepted",
           "--muon-use-syrk --no-use-layer-wise-param-layout")
    accept(g, "Megatron's CPU-offloaded step: torch's optimizer (megazero's host step is torch's fused AdamW), "
           "overlapping the step with the copies (megazero's offloaded step always streams chunks while others "
           "copy) and pinned host buffers (the DeepSpeed JSON's offload_optimizer.pin_memory): what megazero's "
           "--optimizer-cpu-offload does; accepted", "--use-torch-optimizer-for-cpu-offload "
           "--overlap-cpu-optimizer-d2h-h2d --no-pin-cpu-grads --no-pin-cpu-params")
    refuse(g, "megazero applies no weight decay to norms and biases (Megatron's default rule); decaying the query "
           "and key norms does not exist; drop the flag", "--apply-wd-to-qk-layernorm",
           "--no-weight-decay-cond-type")
    refuse(g, "megazero computes the language-model loss in fp32 from logits in the compute dtype (Megatron's "
           "default); another precision does not exist; drop the flag", "--fp16-lm-cross-entropy",
           "--output-logit-dtype")
    refuse(g, "megazero leaves torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction at PyTorch's "
           "default; drop the flag", "--disable-bf16-reduced-precision-matmul")
    refuse(g, "different initial weights per data-parallel rank do not exist in megazero: the model is a function "
           "of the seed, the same at every layout; drop the flag", "--data-parallel-random-init")
    g(H, "--empty-unused-memory-level", "empty PyTorch's CUDA cache each iteration: megazero never does, Megatron's "
      "default 0; 1 and 2 are refused", int, only=(0,))


def add_data_rows(g: G) -> None:
    """Group "data and tokenizer"."""
    g(H, "--data-args-path", "a file holding the --data-path words (weights and prefixes), read in its place", str)
    g(H, "--per-split-data-args-path", "a JSON file {\"train\": ..., \"valid\": ..., \"test\": ...} holding the "
      "--train-data-path, --valid-data-path and --test-data-path words, read in their place", str)
    g(H, "--dataloader-type", "the order samples are read in: single, megazero's sampler (Megatron's "
      "MegatronPretrainingSampler: each sample once, in order); cyclic (reshuffled epochs) and external loaders do "
      "not exist in megazero", str, choices=("single", "cyclic", "external"), only=("single",))
    g(H, "--mid-level-dataset-surplus", "the surplus of samples each blended dataset's parts build: megazero's "
      "blending uses megatron-core's 0.005", float, only=(0.005,))
    accept(g, "how Megatron's dataset builder loads or counts its cached indices (fast cache loading, deferred "
           "mmap, builder threads, a file of sequence counts): megazero builds and reads its own cache "
           "(--data-cache-path), the same samples; accepted", "--dataloader-fast-cache-load "
           "--dataloader-defer-npy-index-mmap", "--num-dataset-builder-threads --per-dataset-sequences-path")
    refuse(g, "megazero ends documents at their end-of-document tokens: attention within documents is "
           "--reset-attention-mask (data preprocessed with --append-eod); drop the flag",
           "--dataloader-inter-document-masking")
    accept(g, "keep padding tokens found in the data in the loss: megazero masks no padding tokens out of the loss "
           "(--eod-mask-loss masks end-of-document ones); accepted", "--allow-ambiguous-pad-tokens")
    refuse(g, "fill-in-the-middle (FIM) samples do not exist in megazero yet; drop the flag", "--fim-data",
           "--fim-rate --fim-spm-rate --fim-split-sample --fim-fragment-rate --fim-no-prefix --fim-prefix-token "
           "--fim-middle-token --fim-suffix-token --fim-pad-token --fim-eod-token")
    refuse(g, "megazero reads data from files on this machine: object storage and the Multi-Storage Client do not "
           "exist; drop the flag", "--enable-msc", "--object-storage-cache-path")
    accept(g, "Megatron's deprecated switch to turn the Multi-Storage Client off, a no-op in Megatron too; accepted",
           "--disable-msc")
    refuse(g, "megazero pads the vocabulary to a multiple of --make-vocab-size-divisible-by x tp: pass "
           "--make-vocab-size-divisible-by 1 for the least padding", "--no-pad-vocab-size --disable-pad-vocab-size",
           "--padded-vocab-size")
    refuse(g, "megazero's tokenizers load with their files' own settings (no remote code, the fast Hugging Face "
           "tokenizer, SentencePiece's defaults); these options do not exist; drop the flag",
           "--tokenizer-sentencepiece-legacy --no-tokenizer-sentencepiece-ignore-extra-whitespaces "
           "--disable-tokenizer-sentencepiece-ignore-extra-whitespaces --tokenizer-hf-no-use-fast "
           "--tokenizer-hf-no-include-special-tokens --trust-remote-code --use-gigatoken",
           "--tokenizer-metadata --tokenizer-special-tokens --tiktoken-pattern --tiktoken-num-special-tokens "
           "--chat-template")
    refuse(g, "megazero's NullTokenizer ends documents with the id --vocab-size, one past the data's (Megatron's "
           "legacy NullTokenizer); another id does not exist; drop the flag", values="--null-tokenizer-eod-id")
    g(H, "--null-tokenizer-pad-id", "the NullTokenizer's padding id: none (-1, Megatron's default), as megazero's",
      int, only=(-1,))


def add_checkpoint_rows(g: G) -> None:
    """Group "checkpoints and run control"."""
    g(H, "--exit-on-missing-checkpoint", "with --load: stop before any process group starts when it holds no "
      "checkpoint (a mistyped path), instead of training from scratch")
    g(H, ("--no-use-tokenizer-model-from-checkpoint-args", "--disable-use-tokenizer-model-from-checkpoint-args"),
      "do not take the tokenizer recorded in the checkpoint: the tokenizer flags must be given",
      dest="no_use_tokenizer_model_from_checkpoint_args")
    g(M, "--load-main-params-from-ckpt", "with --no-load-optim, take the fp32 master weights from the checkpoint: "
      "megazero's load always does; accepted")
    g(M, "--dist-ckpt-optim-fully-reshardable", "write the optimizer reshardable at any tp, pp, ep and dp: "
      "megazero's --ckpt-format torch_dist always does (fully_reshardable); accepted")
    accept(g, "how Megatron's distributed checkpointing spreads its reads and writes over ranks, processes and "
           "caches, and the checks it skips: megazero's saves and loads have each rank write and read the pieces "
           "it owns, checked; accepted", "--ckpt-fully-parallel-save --no-ckpt-fully-parallel-save "
           "--ckpt-fully-parallel-load --ckpt-fully-parallel-load-per-rank-objects --ckpt-assume-constant-structure "
           "--ckpt-pg-tensors-cache-create --use-persistent-ckpt-worker --async-ckpt-use-cpu-shm "
           "--distrib-optim-fully-reshardable-mem-efficient --no-ckpt-load-validate-sharding-integrity "
           "--disable-ckpt-load-validate-sharding-integrity --no-strict-fsdp-dtensor-load "
           "--disable-strict-fsdp-dtensor-load", "--ckpt-fully-parallel-load-exchange-algo "
           "--ckpt-fully-parallel-save-process-group --ckpt-fully-parallel-load-process-group "
           "--ckpt-pg-tensors-cache-path --dist-ckpt-workers --async-strategy --async-ckpt-cpu-priority "
           "--async-ckpt-io-priority")
    refuse(g, "megazero resumes at any layout: give --tensor-model-parallel-size and --pipeline-model-parallel-size "
           "on the command line and drop the flag", "--use-mp-args-from-checkpoint-args")
    refuse(g, "megazero converts a checkpoint by loading it (--load reads megazero's and torch_dist) and saving "
           "with --ckpt-format torch_dist or megazero; drop the flag", "--ckpt-convert-update-legacy-dist-opt-format",
           "--ckpt-convert-format --ckpt-convert-save")
    refuse(g, "megazero checkpoints always record their tokenizer (resumes and tools read it); drop the flag",
           "--no-save-tokenizer-assets --disable-save-tokenizer-assets")
    refuse(g, "megazero writes megatron-core's current torch_dist layout, with the linears' _extra_state; drop the "
           "flag", "--dist-ckpt-save-pre-mcore-014 --ckpt-drop-redundant-extra-state")
    refuse(g, "megazero writes no rank-local non-persistent checkpoints (nor their replicas): save with "
           "--save-interval, and --async-save to keep training while each one is written", "--replication",
           "--non-persistent-global-ckpt-dir --non-persistent-local-ckpt-algo --replication-jump "
           "--replication-factor")
    refuse(g, "megazero keeps every checkpoint it writes; deleting older ones does not exist; drop the flag",
           values="--save-retain-interval")
    refuse(g, "dumping parameters, activations, gradients or routing counts every N iterations does not exist in "
           "megazero; drop the flag", values="--save-params-interval --save-activations-interval "
           "--save-tokens-per-expert-interval --save-wgrads-interval --save-dgrads-interval")
    refuse(g, "hashing checkpoint files to verify them does not exist in megazero yet; drop the flag",
           "--verify-integrity")
    refuse(g, "rewriting the iteration of a loaded checkpoint does not exist in megazero (--ckpt-step chooses which "
           "saved iteration to load); drop the flag", values="--override-ckpt-iteration")
    g(H, "--exit-signal", "the signal --exit-signal-handler saves and exits on: SIGTERM, megazero's; another is "
      "refused", str, only=("SIGTERM",))
    refuse(g, "megazero's --exit-signal-handler saves and exits on SIGTERM; handlers in the data loader's workers "
           "or for SIGINT do not exist; drop the flag",
           "--exit-signal-handler-for-dataloader --exit-signal-handler-for-training")
    accept(g, "see --manual-gc (megazero leaves the collector alone); accepted",
           "--no-manual-gc-eval --disable-manual-gc-eval")
    refuse(g, "megazero synchronizes with the device at each --log-interval; a synchronization every N iterations "
           "does not exist; drop the flag", values="--train-sync-interval")
    refuse(g, "comparing weight hashes across data-parallel replicas and GPU sniff tests do not exist in megazero "
           "(--log-straggler names slow ranks); drop the flag",
           values="--check-weight-hash-across-dp-replicas-interval --gpu-sniff-test-interval")
    refuse(g, "evaluation in megazero runs --eval-iters batches of the training batch sizes every --eval-interval "
           "iterations on one validation set; other sizes, starts, full passes and several sets do not exist; drop "
           "the flag", "--test-mode --full-validation --multiple-validation-sets", "--start-eval-at-iter "
           "--eval-global-batch-size --eval-micro-batch-size --validation-set-names")
    refuse(g, "dumping the parameter-to-group map does not exist in megazero; drop the flag",
           values="--dump-param-to-param-group-map")


def add_logging_rows(g: G) -> None:
    """Group "logging"."""
    g(H, "--timing-log-level", "how fine the timers are: 0 (megazero's: the iteration, and with "
      "--log-timers-to-tensorboard forward-backward and optimizer); finer levels do not exist in megazero", int,
      only=(0,))
    accept(g, "how Megatron reports its timers over ranks, and a barrier before them: megazero's --log-straggler "
           "reports the slowest and fastest ranks per phase; accepted", "--no-barrier-with-level-1-timing",
           "--timing-log-option")
    refuse(g, "megazero always writes the loss scale; drop the flag",
           "--no-log-loss-scale-to-tensorboard --disable-log-loss-scale-to-tensorboard")
    refuse(g, "megazero logs memory in every log line (--log-interval; --log-memory-to-tensorboard for "
           "TensorBoard); another interval, nvidia-smi's figure and energy do not exist; drop the flag",
           "--log-device-memory-used --log-energy", "--log-memory-interval")
    refuse(g, "progress.txt does not exist in megazero: its metrics file (--metrics-file) records every log "
           "interval; drop the flag", "--log-progress")
    refuse(g, "Weights & Biases reads its entity from WANDB_ENTITY in the environment; drop the flag",
           values="--wandb-entity")
    refuse(g, "tracing the router's decisions does not exist in megazero yet; drop the flag",
           "--moe-routing-trace-capture-logits --moe-routing-trace-capture-hidden-states "
           "--moe-routing-trace-dump-weights", "--moe-routing-trace-path --moe-routing-trace-max-training-iters")


def add_mtp_rows_newer(g: G) -> None:
    """Group "multi-latent attention, RoPE scaling and multi-token prediction": Megatron-core's newer MTP options."""
    refuse(g, "megazero's multi-token prediction modules each have their own layer, sit on the last pipeline stage "
           "after the last layer, and train the model through their loss; a shared repeated layer, a stage of their "
           "own, detached heads and hidden-state mixing do not exist; drop the flag",
           "--mtp-standalone --mtp-use-repeated-layer --mtp-detach-heads --mtp-hsm")
