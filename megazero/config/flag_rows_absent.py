"""The flag table's groups for Megatron-LM features megazero does not have: Transformer Engine with FP8 and FP4,
DeepSeek sparse attention and Gated DeltaProduct, CUDA graphs, the inference engine, RL, SFT and distillation,
BERT and vision models, and the cluster services around a run (profilers, fault tolerance, telemetry). Each
refused flag stops the run before any process group starts with its group's message, which says what megazero
has instead; the switches that turn such a feature (or a part of it) off are accepted, being what megazero does.
``flags`` calls :func:`add_absent_groups` after its own groups."""

from __future__ import annotations

from typing import Any, Callable

from megazero.config.flag_rows import accept, refuse

__all__ = ["add_absent_groups", "NO_TE", "NO_FP8"]

H, M, R = "honoured", "mapped", "refused"
NO_TE = "Transformer Engine does not exist in megazero; its layers are megazero's own (megazero.mpu)"
NO_FP8 = "FP8 and FP4 training do not exist in megazero yet; use --bf16 (or --fp16)"


def add_absent_groups(group: Callable[[str], Callable[..., Any]]) -> None:
    """Add the groups; ``group(name)`` gives the row adder of the group ``name`` (``flags._group``)."""
    _transformer_engine(group("not in megazero: Transformer Engine, FP8 and FP4"))
    _hybrid(group("not in megazero: DeepSeek sparse attention, Gated DeltaProduct, hybrid MTP patterns"))
    _cuda_graphs(group("not in megazero: CUDA graphs"))
    _inference(group("not in megazero: the inference engine"))
    _post_training(group("not in megazero: RL, SFT, distillation, BERT, retrieval and vision models"))
    _services(group("not in megazero: profilers, fault tolerance, restarts and telemetry"))


def _transformer_engine(g) -> None:
    refuse(g, f"{NO_TE}; drop the flag", "--tp-comm-overlap --te-rng-tracker --tp-comm-overlap-rs-dgrad",
           "--tp-comm-overlap-cfg --tp-comm-bootstrap-backend")
    accept(g, "turn off a part of Transformer Engine's tensor-parallel communication overlap (--tp-comm-overlap), "
           "which megazero does not have; accepted", "--no-tp-comm-bulk-wgrad --disable-tp-comm-bulk-wgrad "
           "--no-tp-comm-bulk-dgrad --disable-tp-comm-bulk-dgrad --no-tp-comm-overlap-ag --disable-tp-comm-overlap-ag "
           "--no-tp-comm-overlap-rs --disable-tp-comm-overlap-rs --no-tp-comm-split-ag --disable-tp-comm-split-ag "
           "--no-tp-comm-split-rs --disable-tp-comm-split-rs")
    accept(g, "compute the weight gradients in higher precision than FP8: megazero has no FP8, every gradient is "
           "computed in the training precision; accepted", "--no-fp8-wgrad --disable-fp8-wgrad")
    refuse(g, NO_FP8, "--fp8-param-gather --fp8-output-proj --first-last-layers-bf16 --fp4-param-gather "
           "--keep-fp8-transpose-cache --reuse-grad-buf-for-mxfp8-param-ag --moe-router-padding-for-quantization "
           "--moe-router-padding-for-fp8 --use-kitchen-attention",
           "--fp8-format --fp8-recipe --fp8-margin --fp8-interval --fp8-amax-history-len --fp8-amax-compute-algo "
           "--fp8-quantizer-factory --num-layers-at-start-in-bf16 --num-layers-at-end-in-bf16 --fp4-format "
           "--fp4-recipe --fp4-quantizer-factory --te-precision-config-file --kitchen-attention-backend "
           "--kitchen-config-file --kitchen-recipe-number")


def _hybrid(g) -> None:
    refuse(g, "DeepSeek sparse attention (DSA, its indexer and its loss) does not exist in megazero: its attention "
           "is dense (multi-head, grouped-query or multi-latent); drop the flag", "--dsa-indexer-use-sparse-loss "
           "--dsa-indexer-rope-interleaved --no-dsa-indexer-rotate-activation --disable-dsa-indexer-rotate-activation "
           "--no-dsa-indexer-scoring-relu --disable-dsa-indexer-scoring-relu --dsa-indexer-k-norm-fp32",
           "--dsa-indexer-n-heads --dsa-indexer-head-dim --dsa-indexer-topk --dsa-indexer-topk-freq "
           "--dsa-indexer-skip-topk-offset --dsa-indexer-loss-coeff --dsa-kernel-backend "
           "--dsa-indexer-k-norm-epsilon")
    refuse(g, "Gated DeltaProduct (several Householder steps per token) does not exist in megazero: its linear "
           "attention is Gated DeltaNet (G in --hybrid-layer-pattern, or --experimental-attention-variant "
           "gated_delta_net); drop the flag", "--gdp-cutedsl-kernel",
           "--gdp-num-householder --gdp-num-chunk-states-to-recompute")
    refuse(g, "a hybrid pattern for the multi-token prediction modules does not exist in megazero: each of its "
           "--mtp-num-layers modules is an attention layer with the model's MLP; drop the flag",
           values="--mtp-hybrid-override-pattern")


def _cuda_graphs(g) -> None:
    g(H, "--cuda-graph-impl", "CUDA graph capture: none, megazero's (it launches kernels one by one); local, "
      "transformer_engine and full_iteration do not exist in megazero yet", str,
      choices=("none", "local", "transformer_engine", "full_iteration"), only=("none",))
    refuse(g, "CUDA graphs do not exist in megazero yet (it launches kernels one by one); drop the flag",
           "--enable-cuda-graph --external-cuda-graph --optimizer-cuda-graph",
           "--cuda-graph-warmup-steps --cuda-graph-scope --cuda-graph-modules")


def _inference(g) -> None:
    refuse(g, "megazero trains: Megatron's inference engine and its serving options do not exist (tools/generate.py "
           "samples from a checkpoint); drop the flag", "--flash-decode --nccl-all-reduce-for-prefill "
           "--inference-fuse-tp-communication --inference-disable-triton-nvls-kernels "
           "--inference-moe-disable-fused-quant-kernels --moe-pad-experts-for-cuda-graph-inference "
           "--inference-rng-tracker --output-bert-embeddings --use-legacy-static-engine --inference-dynamic-batching "
           "--inference-dynamic-batching-track-paused-request-events "
           "--inference-dynamic-batching-track-generated-token-events --decode-only-cuda-graphs "
           "--inference-cuda-graph-all-prefills --enable-chunked-prefill --inference-dynamic-batching-prefix-caching "
           "--no-inference-dynamic-batching-prefix-caching --use-same-sampling-seed-across-dp-ranks "
           "--inference-text-gen-server-logging --no-inference-text-gen-server-logging --inference-wandb-logging "
           "--no-inference-wandb-logging --inference-use-synchronous-zmq-collectives "
           "--no-inference-use-synchronous-zmq-collectives --inference-disable-ep-consensus "
           "--no-inference-disable-ep-consensus",
           "--inference-cuda-graph-scope --symmetric-ar-type --inference-grouped-gemm-backend "
           "--inference-moe-token-dispatcher-type --mlp-chunks-for-prefill --inference-batch-times-seqlen-threshold "
           "--max-tokens-to-oom --bert-embedder-type --inference-max-requests --inference-max-seq-length "
           "--inference-dynamic-batching-buffer-size-gb --inference-dynamic-batching-paused-buffer-size-gb "
           "--inference-dynamic-batching-mamba-memory-ratio --inference-dynamic-batching-block-size "
           "--inference-dynamic-batching-max-requests --inference-dynamic-batching-max-tokens "
           "--inference-dynamic-batching-num-cuda-graphs --inference-cuda-graph-max-tokens "
           "--inference-dynamic-batching-unified-memory-level --num-speculative-tokens "
           "--inference-dynamic-batching-prefix-caching-eviction-policy "
           "--inference-dynamic-batching-prefix-caching-coordinator-policy "
           "--inference-dynamic-batching-prefix-caching-routing-alpha "
           "--inference-dynamic-batching-prefix-caching-mamba-gb "
           "--inference-dynamic-batching-cuda-graph-mixed-prefill-count "
           "--inference-dynamic-batching-cuda-graph-sizing-distribution --inference-dynamic-batching-sampling-backend "
           "--inference-dynamic-batching-async-sched-mode --inference-dynamic-batching-logprobs-mode "
           "--inference-logging-step-interval --inference-coordinator-port --mamba-inference-conv-states-dtype "
           "--mamba-inference-ssm-states-dtype --inference-shards")


def _post_training(g) -> None:
    refuse(g, "reinforcement learning (GRPO) does not exist in megazero: it pretrains and fine-tunes with the "
           "language-model loss; drop the flag", "--perform-rl-step --rl-durable-rollout-bank "
           "--grpo-filter-groups-with-same-reward --rl-offload-optimizer-during-inference --rl-persist-cuda-graphs "
           "--no-rl-persist-cuda-graphs --rl-partial-rollouts --no-rl-partial-rollouts "
           "--rl-inference-logprobs-is-correction --no-rl-inference-logprobs-is-correction --rl-use-sequence-packing "
           "--no-rl-use-sequence-packing --rl-training-cuda-graphs --no-rl-training-cuda-graphs "
           "--rl-offload-inference-model-weights-when-idle --no-rl-offload-inference-model-weights-when-idle "
           "--rl-verify-model-weights-swap --no-rl-verify-model-weights-swap --rl-skip-bos-token "
           "--no-rl-skip-bos-token --rl-profile",
           "--rl-prompts-per-eval --grpo-prompts-per-step --grpo-group-size --rl-generation-lag "
           "--rl-max-inflight-requests --rl-submission-granularity --rl-consumption-granularity "
           "--rl-rollout-bank-dir --rl-rollout-bank-max-bytes --grpo-iterations --grpo-clamp-eps-lower "
           "--grpo-clamp-eps-upper --grpo-kl-beta --grpo-entropy-term-weight --langrl-env-config "
           "--rl-default-temperature --rl-default-top-p --rl-default-top-k --rl-kv-cache-management-mode "
           "--rl-importance-sampling-truncation-coef --rl-sequence-packing-max-sequences-per-bin "
           "--rl-sequence-packing-algo --rl-inference-tensor-model-parallel-size "
           "--rl-inference-pipeline-model-parallel-size --rl-inference-expert-model-parallel-size "
           "--rl-inference-expert-tensor-model-parallel-size --rl-inference-model-unified-memory-level "
           "--refit-method --rl-profile-dir --rl-inference-parsers")
    refuse(g, "Megatron's SFT mode (chat-formatted samples) does not exist in megazero: fine-tune with --finetune "
           "on .bin/.idx data; drop the flag", "--sft", "--sft-tokenizer-prompt-format")
    refuse(g, "distillation from saved teacher logits does not exist in megazero; drop the flag",
           "--logits-load-ignore-errors", "--logits-save-top-k --logits-save-top-p --logits-save-top-p-min-k "
           "--logits-save-dir --logits-save-dtype --logits-load-dir --logits-load-decode-threads "
           "--logits-load-prefetch-factor --logits-load-msc-prefetch-depth --logits-load-kd-loss-alpha")
    refuse(g, "megazero trains GPTs: BERT, retrieval (ICT, REALM) and vision (ViT, DINO) models do not exist; drop "
           "the flag", "--biencoder-shared-query-context-model --use-one-sent-docs --retriever-score-scaling "
           "--no-data-sharding --vision-pretraining --dino-norm-last-layer",
           "--sample-rate --mask-prob --short-seq-prob --ict-head-size --biencoder-projection-dim --ict-load "
           "--bert-load --titles-data-path --query-in-block-prob --evidence-data-path "
           "--retriever-report-topk-accuracies --block-data-path --embedding-path --indexer-batch-size "
           "--indexer-log-interval --num-classes --img-h --img-w --num-channels --patch-dim --classes-fraction "
           "--data-per-class-fraction --head-lr-mult --vision-pretraining-type --vision-backbone-type "
           "--swin-backbone-type --mask-type --mask-factor --iter-per-epoch --dino-local-img-size "
           "--dino-local-crops-number --dino-head-hidden-size --dino-bottleneck-size --dino-freeze-last-layer "
           "--dino-warmup-teacher-temp --dino-teacher-temp --dino-warmup-teacher-temp-epochs")


def _services(g) -> None:
    refuse(g, "megazero has no built-in profiler switch: run it under nsys or torch.profiler (its phases appear as "
           "megazero::<name> ranges), and --track-memory for memory; drop the flag", "--profile "
           "--use-pytorch-profiler --pytorch-profiler-collect-shapes --pytorch-profiler-collect-callstack "
           "--pytorch-profiler-collect-chakra --record-memory-history --record-shapes --nvtx-ranges "
           "--run-workload-inspector-server", "--profile-step-start --profile-step-end --profile-ranks "
           "--memory-snapshot-path")
    g(H, "--rerun-mode", "Megatron's re-run engine (repeating a step to tell a transient fault from a bug): disabled, "
      "as megazero has none (its own check stops the run when the loss or gradient norm stops being finite); "
      "validate_results and report_stats are refused", str, choices=("disabled", "validate_results", "report_stats"),
      only=("disabled",))
    refuse(g, "the re-run engine's checks and fault injection do not exist in megazero (it stops the run when the "
           "loss or the gradient norm stops being finite); drop the flag", "--check-for-spiky-loss "
           "--check-for-large-grads", "--error-injection-rate --error-injection-type "
           "--result-rejected-tracker-filename")
    refuse(g, "in-process restarts, NVIDIA's fault-tolerance package, ADLR autoresume and fault injection do not "
           "exist in megazero: a failed run stops every rank naming the cause, and a relaunch with --load resumes "
           "from the last checkpoint; drop the flag", "--inprocess-restart --inprocess-empty-cuda-cache "
           "--enable-ft-package --calc-ft-timeouts --adlr-autoresume",
           "--inprocess-max-iterations --inprocess-monitor-thread-interval --inprocess-monitor-process-interval "
           "--inprocess-progress-watchdog-interval --inprocess-heartbeat-interval --inprocess-soft-timeout "
           "--inprocess-hard-timeout --inprocess-heartbeat-timeout --inprocess-barrier-timeout "
           "--inprocess-completion-timeout --inprocess-last-call-wait --inprocess-termination-grace-time "
           "--inprocess-granularity --inprocess-active-world-size --ft-num-warmup-iters --adlr-autoresume-interval "
           "--fault-injector-ranks --fault-injector-num-ranks --fault-injector-fault-types "
           "--fault-injector-fault-probabilities --fault-injector-fault-delay --fault-injector-delay-start-iteration "
           "--fault-injector-mtti-seconds --fault-injector-offset-seconds --fault-injector-seed")
    accept(g, "turn off NVIDIA's internal one_logger, which megazero does not have; accepted", "--no-one-logger")
    refuse(g, "NVIDIA's one_logger and OpenTelemetry do not exist in megazero (its metrics go to the log, "
           "TensorBoard, Weights & Biases and --metrics-file); drop the flag", "--one-logger-async --otel-enabled",
           "--one-logger-project --one-logger-run-name --app-tag-run-name --app-tag-run-version --otel-service-name "
           "--otel-span-groups")
    refuse(g, "megazero takes its configuration from flags and --deepspeed_config; a YAML file of arguments is not "
           "read: pass the flags", values="--yaml-cfg")
