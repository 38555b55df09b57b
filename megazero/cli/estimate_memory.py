"""Will this GPT training plan fit on the GPU? Per-GPU weights/grads/optimizer/activations.

Two ways to describe the plan:

    # explicit flags
    python tools/estimate_memory.py --model-preset 13b --tp 4 --dp 16 --zero-stage 3 \\
        --micro-batch-size 2 --bf16 --recompute-granularity full --use-flash-attn --global-batch-size 1024 \\
        --device-memory-gb 80

    # exactly the arguments pretrain_gpt.py would get (validated as it would validate
    # them, without looking for the data/tokenizer files)
    python tools/estimate_memory.py --world-size 16 --device-memory-gb 80 --train-args --num-layers 40 ...

Installed: ``megazero-estimate-memory``. Prints the table, the parameter count and FLOPs per
iteration. Exit status: 0 fits (or no --device-memory-gb), 1 does not fit (with what to
change), 2 invalid plan. Formulas and citations: megazero/observe/planner.py.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from megazero.cli.common import setup_logging, tool_parser, write_output
from megazero.model.config import GPTConfig, gpt_preset
from megazero.training.config import ConfigError
from megazero.observe.planner import GiB, MemoryEstimate, estimate_memory, plan_of
from megazero.utils.progress import Progress

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    add = p.add_argument
    add("--model-preset", help="gpt-tiny ... gpt-175b ('gpt-' optional); shape flags override it")
    for name in ("--num-layers", "--hidden-size", "--num-query-groups", "--ffn-hidden-size", "--seq-length",
                 "--vocab-size"):
        add(name, type=int, help="model shape (as pretrain_gpt.py)")
    add("--num-attention-heads", "--num-heads", dest="num_attention_heads", type=int, help="model shape")
    add("--swiglu", action="store_true", help="SwiGLU MLP")
    add("--untie-embeddings-and-output-weights", action="store_true", help="a separate output layer")
    add("--tensor-model-parallel-size", "--tp", dest="tp", type=int, default=1, help="tensor-parallel size")
    add("--pipeline-model-parallel-size", "--pp", dest="pp", type=int, default=1, help="pipeline-parallel size")
    add("--virtual-pipeline-model-parallel-size", dest="virtual_pp", type=int, default=1,
        help="model chunks per pipeline rank (interleaved 1F1B)")
    add("--dp", type=int, help="data-parallel size (default: --world-size / (tp x pp))")
    add("--world-size", type=int, help="total GPUs (gives dp when --dp is absent)")
    add("--zero-stage", type=int, default=1, help="ZeRO stage 0-3")
    add("--micro-batch-size", type=int, default=1, help="sequences per rank per forward")
    add("--global-batch-size", type=int, help="for the FLOPs per iteration (default micro x dp)")
    add("--bf16", action="store_true", help="bf16 weights and activations (default: fp32)")
    add("--fp16", action="store_true", help="fp16 weights and activations")
    add("--recompute-granularity", "--recompute", dest="recompute", choices=("full", "selective"),
        help="activation recomputation (default: none)")
    add("--sequence-parallel", action="store_true", help="shard activations over the tensor-parallel group")
    add("--use-flash-attn", "--flash-attn", dest="flash_attn", action="store_true",
        help="flash attention (no seq x seq score matrix)")
    add("--grad-accum-dtype", choices=("fp32", "bf16", "fp16"), help="gradient dtype (default: weights' dtype)")
    add("--offload-optimizer", choices=("none", "cpu", "nvme"), default="none",
        help="ZeRO-Offload: the optimizer partition's fp32 masters and Adam moments on the host or NVMe")
    add("--optimizer-offload-fraction", "--offload-ratio", dest="optimizer_offload_fraction", type=float,
        default=1.0, help="fraction of the optimizer partition offloaded")
    add("--offload-param", choices=("none", "cpu", "nvme"), default="none",
        help="ZeRO-Infinity (ZeRO-3): the weight partition on the host or NVMe")
    add("--offload-param-max-in-cpu", type=float, default=1e9,
        help="with --offload-param nvme: elements of the partition kept in host memory (DeepSpeed's max_in_cpu)")
    add("--device-memory-gb", "--gpu-memory-gb", dest="device_memory_gb", type=float,
        help="device capacity in GiB (an '80GB' GPU is 80 GiB); enables the fit check")
    add("--compare", nargs="+", metavar="NAME:FLAGS",
        help="several layouts side by side, each 'name:--tp 4 --pp 8 --zero-stage 1' over the other flags")
    add("--train-args", nargs=argparse.REMAINDER,
        help="the rest of the line is pretrain_gpt.py's arguments; needs --world-size")
    return p


def _plan_from_flags(a: argparse.Namespace) -> tuple[GPTConfig, dict]:
    shape = {k: getattr(a, k) for k in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
                                        "ffn_hidden_size", "seq_length", "vocab_size") if getattr(a, k) is not None}
    if a.swiglu:
        shape["activation"] = "swiglu"
    if a.untie_embeddings_and_output_weights:
        shape["tie_embeddings"] = False
    if "seq_length" in shape:
        shape.setdefault("max_position_embeddings", shape["seq_length"])
    shape["vocab_padding_tp"] = a.tp  # as training pads: to make_vocab_size_divisible_by x tp (Megatron)
    try:
        config = gpt_preset(a.model_preset, **shape) if a.model_preset else GPTConfig(**shape)
    except TypeError:
        raise ConfigError("give --model-preset or all of --num-layers --hidden-size --num-attention-heads "
                          "--seq-length --vocab-size") from None
    if a.bf16 and a.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    dp = a.dp
    if dp is None:
        if a.world_size is None:
            raise ConfigError("give --dp or --world-size")
        if a.world_size % (a.tp * a.pp):
            raise ConfigError(f"world size {a.world_size} is not divisible by tp {a.tp} x pp {a.pp}")
        dp = a.world_size // (a.tp * a.pp)
    if a.sequence_parallel and a.tp == 1:
        raise ConfigError("--sequence-parallel needs --tp > 1")
    config.validate(a.tp)
    plan = dict(tp=a.tp, dp=dp, pp=a.pp, zero_stage=a.zero_stage, micro_batch_size=a.micro_batch_size,
                precision="bf16" if a.bf16 else "fp16" if a.fp16 else "fp32", recompute=a.recompute,
                sequence_parallel=a.sequence_parallel, flash_attn=a.flash_attn, grad_accum_dtype=a.grad_accum_dtype,
                global_batch_size=a.global_batch_size, virtual_pp=a.virtual_pp,
                offload_optimizer=a.offload_optimizer, offload_ratio=a.optimizer_offload_fraction,
                offload_param=a.offload_param, offload_param_max_in_cpu=a.offload_param_max_in_cpu)
    if a.offload_param != "none" and a.zero_stage != 3:
        raise ConfigError("--offload-param needs --zero-stage 3 (it offloads the rank's weight partition)")
    return config, plan


def _plan_from_train_args(a: argparse.Namespace) -> tuple[GPTConfig, dict]:
    from megazero.training.arguments import describe, parse_args

    if a.world_size is None:
        raise ConfigError("--train-args needs --world-size (the number of processes pretrain_gpt.py would run)")
    cfg = parse_args(a.train_args, a.world_size, check_files=False)
    write_output(describe(cfg))  # the plan as pretrain_gpt.py resolves it: part of the output
    return cfg.model, plan_of(cfg, grad_accum_dtype=a.grad_accum_dtype)


def suggestions(config: GPTConfig, plan: dict, device_memory_gib: float) -> list[str]:
    """Single changes to the plan that would make it fit, each with its total."""
    candidates = []
    if plan["zero_stage"] < 3:
        candidates.append(("--zero-stage 3", dict(zero_stage=3)))
    if plan.get("offload_optimizer", "none") == "none" and plan["zero_stage"] > 0:
        candidates.append(("--optimizer-cpu-offload (host memory per rank below)", dict(offload_optimizer="cpu")))
    if plan.get("offload_param", "none") == "none" and plan["zero_stage"] == 3:
        candidates.append(("offload_param cpu and offload_optimizer cpu in the JSON (ZeRO-Infinity)",
                           dict(offload_param="cpu", offload_optimizer="cpu", offload_ratio=1.0)))
    if plan["recompute"] != "full":
        candidates.append(("--recompute-granularity full", dict(recompute="full")))
    if plan["micro_batch_size"] > 1:
        candidates.append(("--micro-batch-size 1", dict(micro_batch_size=1)))
    if plan["zero_stage"] > 0:
        candidates.append((f"dp {plan['dp'] * 2} (twice the GPUs)", dict(dp=plan["dp"] * 2)))
    tp2 = plan["tp"] * 2
    try:
        config.validate(tp2)
        candidates.append((f"--tp {tp2} (dp {max(plan['dp'] // 2, 1)} on the same GPUs)",
                           dict(tp=tp2, dp=max(plan["dp"] // 2, 1))))
    except ValueError:
        pass
    if plan["tp"] > 1 and not plan["sequence_parallel"]:
        candidates.append(("--sequence-parallel", dict(sequence_parallel=True)))
    out = []
    with Progress("estimated", total=len(candidates), unit="alternative plans", logger=log) as progress:
        for label, change in candidates:
            est = estimate_memory(config, **{**plan, **change})
            if est.fits(device_memory_gib):
                out.append(f"{label}: {est.device_total / GiB:.2f} GiB")
            progress.update()
    return out


def compare(argv: Sequence[str], layouts: Sequence[str]) -> str:
    """A table of several layouts (memory per GPU by kind, bubble, bytes sent per GPU per step)."""
    rows = []
    with Progress("estimated", total=len(layouts), unit="layouts", logger=log) as progress:
        for item in layouts:
            name, _, flags = item.partition(":")
            a = build_parser().parse_args(list(argv) + flags.split())
            config, plan = _plan_from_flags(a)
            rows.append((name, estimate_memory(config, **plan)))
            progress.update()
    kinds = [("weights", lambda e: e.params), ("gradients", lambda e: e.grads),
             ("optimizer states", lambda e: e.optimizer), ("activations", lambda e: e.activations),
             ("ZeRO-3 gather buffers", lambda e: e.buffers), ("total memory", lambda e: e.total),
             ("NCCL communicators (est.)", lambda e: e.nccl), ("total with NCCL", lambda e: e.device_total)]
    if any(e.host_total or e.nvme or e.nvme_params for _, e in rows):
        kinds += [("host memory (offload)", lambda e: e.host_total),
                  ("NVMe files (offload)", lambda e: e.nvme + e.nvme_params)]
    out = [f"{'per GPU':<34}" + "".join(f"{n:>14}" for n, _ in rows)]
    out += [f"  {k + ' (GiB)':<32}" + "".join(f"{f(e) / GiB:>14.2f}" for _, e in rows) for k, f in kinds]
    out.append(f"  {'pipeline bubble':<32}" + "".join(f"{e.pipeline.get('bubble', 0.0):>14.3f}" for _, e in rows))
    for key, label in (("dp", "sent, data parallel (GiB)"), ("tp", "sent, tensor parallel (GiB)"),
                       ("pp", "sent, pipeline p2p (GiB)"), ("total", "sent per step (GiB)")):
        out.append(f"  {label:<32}" + "".join(f"{e.traffic[key] / GiB:>14.2f}" for _, e in rows))
    return "\n".join(out)


def _not_fitting(config: GPTConfig, plan: dict, est: MemoryEstimate, device_gib: float) -> None:
    over = est.device_total / GiB - device_gib
    fixes = suggestions(config, plan, device_gib)
    log.error(f"error: the plan needs {est.device_total / GiB:.2f} GiB per GPU, {over:.2f} GiB more than the "
              f"{device_gib:g} GiB available. "
              + ("Changes that would fit: " + "; ".join(fixes) + "." if fixes else
                 "No single change fits: combine a larger --tp / more GPUs (dp), a higher --zero-stage and "
                 "--recompute-granularity full, or use a smaller micro batch."))


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging()
    if a.compare:
        argv = list(sys.argv[1:] if argv is None else argv)
        i = argv.index("--compare")
        j = i + 1 + len(a.compare)
        try:
            write_output(compare(argv[:i] + argv[j:], a.compare))
        except (ConfigError, ValueError) as e:
            log.error("error: %s", e)
            return 2
        return 0
    try:
        config, plan = _plan_from_train_args(a) if a.train_args is not None else _plan_from_flags(a)
        est: MemoryEstimate = estimate_memory(config, **plan)
    except (ConfigError, ValueError) as e:
        log.error("error: %s", e)
        return 2
    write_output(est.to_text(a.device_memory_gb))
    if a.device_memory_gb is None or est.fits(a.device_memory_gb):
        return 0
    _not_fitting(config, plan, est, a.device_memory_gb)
    return 1
