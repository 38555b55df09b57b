"""Will this GPT training plan fit on the GPU? Per-GPU weights/grads/optimizer/activations, bytes sent.

    python tools/estimate_memory.py --world-size 64 --model-preset gpt-13b --tp 4 --zero-stage 3 \\
        --micro-batch-size 2 --global-batch-size 1024 --bf16 --recompute-granularity full --use-flash-attn

The flags are pretrain_gpt.py's: the same command line, validated as it validates it, without
looking for the data or tokenizer files; the flags only training needs (--lr, --train-iters,
the data and the tokenizer) may be left out. This tool's own: --world-size (the ranks torchrun
would start), --device-memory-gb, --compare. Installed: ``megazero-estimate-memory``. Prints the
resolved run, the table, the parameter count, FLOPs and bytes sent per GPU per step. Exit status: 0
fits, 1 does not fit (with what to change), 2 invalid plan. Formulas and citations:
megazero/observe/planner.py.
"""

from __future__ import annotations

import argparse
import logging
import shlex
from typing import Callable, Optional, Sequence

from megazero.cli.common import write_output
from megazero.cli.planning import add_device_memory, plan_config, planning_parser, split_own, tool_args
from megazero.config.arguments import build_parser as pretrain_parser
from megazero.config.arguments import describe
from megazero.config.train_config import ConfigError, TrainConfig
from megazero.model.config import GPTConfig
from megazero.observe.planner import GiB, MemoryEstimate, estimate_memory, plan_of
from megazero.utils.progress import Progress

log = logging.getLogger(__name__)

# This tool's earlier spellings, read as pretrain_gpt.py's flag (a line says which).
_RENAMED = {"--num-heads": "--num-attention-heads", "--recompute": "--recompute-granularity",
            "--flash-attn": "--use-flash-attn", "--offload-ratio": "--optimizer-offload-fraction"}
_JSON_ONLY = {  # earlier spellings whose setting pretrain_gpt.py takes from its DeepSpeed JSON only
    "--offload-param": 'zero_optimization.offload_param {{"device": "{v}"}} (ZeRO-3)',
    "--offload-param-max-in-cpu": 'zero_optimization.offload_param {{"device": "nvme", "max_in_cpu": {v}}}',
    "--offload-optimizer": 'zero_optimization.offload_optimizer {{"device": "{v}", "nvme_path": ...}}',
    "--grad-accum-dtype": 'data_types {{"grad_accum_dtype": "{v}"}}'}


def _add_own(add: Callable) -> None:
    add("--world-size", type=int, help="ranks of the launch (torchrun's world size); dp = world / (tp x cp x pp)")
    add_device_memory(add, "a larger total with the NCCL estimate exits 1")
    add("--compare", nargs="+", metavar="NAME:FLAGS",
        help="several layouts side by side, each 'name:--tp 4 --pp 8 --zero-stage 1' (pretrain_gpt.py's flags) "
             "over the other flags")


def build_parser() -> argparse.ArgumentParser:
    """pretrain_gpt.py's flags and this tool's own (its --help)."""
    return planning_parser("estimate_memory.py", __doc__, _add_own)


def _legacy(words: Sequence[str]) -> tuple[list[str], Optional[int]]:
    """Earlier spellings of this tool as pretrain_gpt.py's: (words, the --dp given, if any); a setting
    pretrain_gpt.py reads from its DeepSpeed JSON alone is refused, naming the key."""
    out, dp, i, words = [], None, 0, list(words)
    while i < len(words):
        word = words[i]
        name, eq, value = word.partition("=")
        takes_value = name in _JSON_ONLY or name == "--dp"
        if takes_value and not eq:
            if i + 1 >= len(words):
                raise ConfigError(f"{name} needs a value")
            value, i = words[i + 1], i + 1
        i += 1
        if name == "--train-args":
            log.info("--train-args is not needed: the flags are pretrain_gpt.py's wherever they stand")
        elif name in _RENAMED:
            log.info(f"{name}: read as pretrain_gpt.py's {_RENAMED[name]}")
            out.append(_RENAMED[name] + eq + value)
        elif name == "--dp":
            dp = int(value)
        elif name == "--offload-optimizer" and value == "cpu":
            log.info("--offload-optimizer cpu: read as pretrain_gpt.py's --optimizer-cpu-offload")
            out.append("--optimizer-cpu-offload")
        elif name == "--grad-accum-dtype" and value == "fp32":
            log.info("--grad-accum-dtype fp32: read as pretrain_gpt.py's --accumulate-allreduce-grads-in-fp32")
            out.append("--accumulate-allreduce-grads-in-fp32")
        elif name in _JSON_ONLY and value != "none":
            raise ConfigError(f"{name} {value}: pretrain_gpt.py takes this from --deepspeed-config, "
                              f"{_JSON_ONLY[name].format(v=value)}; pass that JSON")
        elif name not in _JSON_ONLY:
            out.append(word)
    return out, dp


def _world(words: Sequence[str], world_size: Optional[int], dp: Optional[int]) -> int:
    """--world-size, or the earlier --dp times the model-parallel ranks (they must agree when both are given)."""
    if dp is None:
        if world_size is None:
            build_parser().parse_args(list(words))  # an unknown flag (--world-sizes) is the first thing to say
            raise ConfigError("give --world-size (the ranks torchrun would start for this launch)")
        return world_size
    ns, _ = pretrain_parser().parse_known_args(list(words))
    world = dp * (ns.tp or 1) * (ns.context_parallel_size or 1) * (ns.pp or 1)
    if world_size is not None and world_size != world:
        raise ConfigError(f"--dp {dp} and --world-size {world_size} disagree (dp x tp x cp x pp = {world}); "
                          "give --world-size alone")
    log.info(f"--dp {dp}: read as --world-size {world} (dp x tp x cp x pp)")
    return world


def _config(words: Sequence[str], world_size: Optional[int]) -> TrainConfig:
    words, dp = _legacy(words)
    return plan_config(words, _world(words, world_size, dp), build_parser())


def suggestions(config: GPTConfig, plan: dict, device_memory_gib: float) -> list[str]:
    """Single changes to the plan that would make it fit, each with its total."""
    world = plan["tp"] * plan.get("context_parallel", 1) * plan.get("pp", 1) * plan["dp"]
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
        candidates.append((f"--world-size {world * 2} (dp {plan['dp'] * 2})", dict(dp=plan["dp"] * 2)))
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


_TRAFFIC_ROWS = (("dp", "sent, data parallel (GiB)"), ("edp", "sent, expert data parallel (GiB)"),
                 ("tp", "sent, tensor parallel (GiB)"), ("cp", "sent, context parallel (GiB)"),
                 ("ep", "sent, expert all-to-all (GiB)"), ("pp", "sent, pipeline p2p (GiB)"),
                 ("total", "sent per step (GiB)"))


def compare(words: Sequence[str], layouts: Sequence[str], world_size: Optional[int]) -> str:
    """A table of several layouts (memory per GPU by kind, bubble, bytes sent per GPU per step), each
    ``name:FLAGS`` (pretrain_gpt.py's flags, after ``words``: later flags win; and its own --world-size)."""
    rows = []
    with Progress("estimated", total=len(layouts), unit="layouts", logger=log) as progress:
        for item in layouts:
            name, _, flags = item.partition(":")
            own, layout = split_own(shlex.split(flags), _add_own)  # a layout may name its own --world-size
            if own.compare or any(w.split("=")[0] in ("--device-memory-gb", "--gpu-memory-gb") for w in flags.split()):
                raise ConfigError(f"--compare {item!r}: a layout takes pretrain_gpt.py's flags and --world-size only")
            cfg = _config(list(words) + layout, own.world_size or world_size)
            rows.append((name, estimate_memory(cfg.model, **plan_of(cfg))))
            progress.update()
    kinds = [("weights", lambda e: e.params), ("gradients", lambda e: e.grads),
             ("optimizer states", lambda e: e.optimizer), ("activations", lambda e: e.activations),
             ("ZeRO-3 gather buffers", lambda e: e.buffers), ("gradients in flight", lambda e: e.grad_buckets)]
    if any(e.embedding_sync for _, e in rows):  # pp > 1, tied or MTP: the peak may be this exchange's
        kinds += [("embedding grad buffer", lambda e: e.embedding_stash),
                  ("(its exchange, after)", lambda e: e.embedding_sync)]
    kinds += [("total memory", lambda e: e.total), ("NCCL communicators (est.)", lambda e: e.nccl),
             ("total with NCCL", lambda e: e.device_total)]
    if any(e.host_total or e.nvme or e.nvme_params for _, e in rows):
        kinds += [("host memory (offload)", lambda e: e.host_total),
                  ("NVMe files (offload)", lambda e: e.nvme + e.nvme_params)]
    out = [f"{'per GPU':<34}" + "".join(f"{n:>14}" for n, _ in rows)]
    out += [f"  {k + ' (GiB)':<32}" + "".join(f"{f(e) / GiB:>14.2f}" for _, e in rows) for k, f in kinds]
    out.append(f"  {'pipeline bubble':<32}" + "".join(f"{e.pipeline.get('bubble', 0.0):>14.3f}" for _, e in rows))
    for key, label in _TRAFFIC_ROWS:
        if key in ("dp", "tp", "pp", "total") or any(e.traffic.get(key) for _, e in rows):
            out.append(f"  {label:<32}" + "".join(f"{e.traffic.get(key, 0.0) / GiB:>14.2f}" for _, e in rows))
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
    parsed = tool_args(argv, build_parser, _add_own)
    if isinstance(parsed, int):
        return parsed
    own, rest = parsed
    try:
        if own.compare:
            write_output(compare(rest, own.compare, own.world_size))
            return 0
        cfg = _config(rest, own.world_size)
        plan = plan_of(cfg)
        est: MemoryEstimate = estimate_memory(cfg.model, **plan)
    except (ConfigError, ValueError) as e:
        log.error("error: %s", e)
        return 2
    write_output(describe(cfg))  # the run as pretrain_gpt.py resolves it
    for note in cfg.notes:
        write_output(f"  > {note}")
    write_output(est.to_text(own.device_memory_gb))
    if est.fits(own.device_memory_gb):
        return 0
    _not_fitting(cfg.model, plan, est, own.device_memory_gb)
    return 1
