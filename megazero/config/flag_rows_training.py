"""The flag table's rows of the groups "batch and schedule" and "optimizer and precision" (Megatron-LM's flags and
megazero's own, QK-clip among them; each optimizer adds its own, ``megazero/zero/optimizers/``). ``flags`` calls
each ``add_*`` inside its group; each ``g(status, names, meaning, type, **kw)`` adds one row (see ``flags.Flag``)."""

from __future__ import annotations

from typing import Any, Callable

from megazero.zero.optimizers import cli_names, registered

__all__ = ["add_schedule_rows", "add_optimizer_rows"]

H, M, R = "honoured", "mapped", "refused"


def _lower(s: str) -> str:
    return s.lower()


def add_schedule_rows(g: Callable[..., Any]) -> None:
    """Group "batch and schedule": batch sizes, run length, the learning-rate schedule."""
    g(H, "--micro-batch-size", "sequences per rank per forward", int)
    g(H, "--global-batch-size", "sequences per optimizer step", int)
    g(H, "--rampup-batch-size", "START INCR SAMPLES: the global batch grows from START by INCR every "
      "SAMPLES / ((global - START) / INCR) consumed samples; the LR schedule advances by the samples consumed. "
      "Also with --train-iters (Megatron-LM asserts against that, yet its GPT-3 175B example combines them)",
      int, nargs=3, metavar=("START", "INCR", "SAMPLES"))
    g(H, "--train-iters", "iterations to train", int)
    g(H, "--train-samples", "samples to train (sample-based schedule)", int)
    g(H, "--train-tokens", "Megatron-DeepSpeed: stop once this many tokens were consumed (with --train-samples)", int)
    g(H, "--lr", "peak learning rate", float)
    g(H, "--min-lr", "learning rate floor after decay", float, default=0.0)
    g(H, "--lr-decay-style", "constant, linear, cosine, inverse-square-root or WSD", str,
      choices=("constant", "linear", "cosine", "inverse-square-root", "WSD"), default="linear")
    g(H, "--lr-wsd-decay-style", "WSD's final annealing: exponential, linear, cosine or minus_sqrt", str,
      choices=("exponential", "linear", "cosine", "minus_sqrt"), default="exponential")
    g(H, "--lr-wsd-decay-iters", "length of WSD's annealing phase in iterations", int)
    g(H, "--lr-wsd-decay-samples", "length of WSD's annealing phase in samples", int)
    g(H, "--lr-warmup-iters", "linear warmup, in iterations", int, default=0)
    g(H, "--lr-warmup-samples", "linear warmup, in samples", int, default=0)
    g(H, "--lr-warmup-fraction", "warmup as a fraction of the decay", float)
    g(H, "--lr-warmup-tokens", "Megatron-DeepSpeed: warmup in tokens", int)
    g(H, "--lr-warmup-init", "learning rate at the start of warmup", float, default=0.0)
    g(H, "--lr-decay-iters", "decay ends here (iterations, warmup included)", int)
    g(H, "--lr-decay-samples", "decay ends here (samples, warmup included)", int)
    g(H, "--lr-decay-tokens", "Megatron-DeepSpeed: decay ends here (tokens, warmup included)", int)
    g(H, ("--override-opt_param-scheduler", "--override-opt-param-scheduler", "--override-lr-scheduler"),
      "on resume, take the LR/WD schedule from the command line instead of checking it against the checkpoint's",
      dest="override_opt_param_scheduler")
    g(H, ("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
          "--use-checkpoint-lr-scheduler"), "on resume, take the LR/WD schedule from the checkpoint", dest="use_checkpoint_opt_param_scheduler")


def add_optimizer_rows(g: Callable[..., Any]) -> None:
    """Group "optimizer and precision": the optimizers, weight decay and clipping, the precision and loss scaling."""
    names = cli_names()  # the registered optimizers' (megazero/zero/optimizers/)
    absent = (("adaptive_muon", "adaptive Muon"), ("soap", "SOAP"))
    summaries = [c.summary for c in registered()]
    g(H, "--optimizer", f"{', '.join(summaries[:-1])} or {summaries[-1]}", _lower, choices=(*names, "dist_muon", *(v for v, _ in absent)), default="adam",
      refuse_values=(("dist_muon", "--optimizer dist_muon: use --optimizer muon, which megazero runs distributed under "
                                   "every ZeRO stage (--muon-tp-mode for tensor-parallel matrices)"),
                     *((v, f"--optimizer {v}: {name} does not exist in megazero; use {', '.join(names)}")
                       for v, name in absent)))
    for c in registered():  # each optimizer's own flags (megazero/zero/optimizers/)
        c.add_flags(g)
    g(H, "--qk-clip", "QK-clip (Kimi K2's MuonClip): after each update, heads whose largest attention logit over "
      "the step exceeded --qk-clip-threshold get their query and key weights scaled down to it (any optimizer; "
      "context parallel size 1)")
    g(H, "--qk-clip-threshold", "QK-clip's threshold on the largest attention logit", float, default=100.0)
    g(H, "--qk-clip-alpha", "QK-clip's balance: queries scale by eta^alpha, keys by eta^(1 - alpha)", float,
      default=0.5)
    g(H, "--log-max-attention-logit", "log the model's largest attention logit (max_attention_logit) at each log "
      "interval (one extra QK^T per attention, without gradient)")
    g(H, "--optimizer-cpu-offload", "Megatron-core: the fp32 masters and Adam moments of this rank's ZeRO partition "
      "live on the host and step there (zero_optimization.offload_optimizer device cpu; ZeRO stage >= 1)")
    g(H, "--optimizer-offload-fraction", "fraction of the optimizer state offloaded by --optimizer-cpu-offload, by "
      "whole groups in model order (offload_optimizer.ratio)", float, default=1.0)
    g(H, "--weight-decay", "decoupled weight decay (not on biases and norms)", float, default=0.01)
    g(H, "--start-weight-decay", "weight decay at the start of the weight-decay schedule", float)
    g(H, "--end-weight-decay", "weight decay at the end of training", float)
    g(H, "--weight-decay-incr-style", "constant, linear or cosine increase from start to end", str,
      choices=("constant", "linear", "cosine"), default="constant")
    g(H, "--clip-grad", "global gradient-norm clip (0 disables)", float, default=1.0)
    g(H, "--adam-beta1", "Adam beta1", float, default=0.9)
    g(H, "--adam-beta2", "Adam beta2", float, default=0.999)
    g(H, "--adam-eps", "Adam epsilon", float, default=1e-08)
    g(H, "--bf16", "bf16 training with fp32 master weights")
    g(H, "--fp16", "fp16 training with fp32 master weights and loss scaling")
    g(H, "--loss-scale", "static fp16 loss scale (default dynamic); with --deepspeed_config the JSON's fp16 block "
      "governs, as in Megatron-DeepSpeed", float)
    g(H, "--initial-loss-scale", "dynamic loss scale start", float, default=2.0 ** 32)
    g(H, "--min-loss-scale", "dynamic loss scale floor", float, default=1.0)
    g(H, "--loss-scale-window", "good steps before the scale grows", int, default=1000)
    g(H, "--hysteresis", "overflows tolerated before the scale shrinks", int, default=2)
    g(H, "--accumulate-allreduce-grads-in-fp32", "accumulate and reduce gradients in fp32 "
      "(data_types.grad_accum_dtype fp32)")
    g(H, "--seed", "random seed", int, default=1234)
