"""Rehearse ranks of a large launch in one CPU process: the real training loop, nothing allocated.

``pretrain_gpt.py`` on W GPUs, rank by rank, here: each named rank runs :func:`pretrain`
itself (the same flags, the same TrainConfig, the same model, ZeRO engine, schedule and
loop) for two iterations at the real shapes, with

- a fake process group (``torch.testing``'s ``FakeStore``; every collective returns at once),
  re-created for each rank, with megazero's group registry reset between ranks;
- the *meta* device as the run's device: tensors have shapes, dtypes and storages of the
  right size but no memory. (Fake CUDA tensors are what the architecture guide asks a step
  to run under; a CPU-only torch cannot make them: copying a CPU tensor to a fake CUDA one and
  autograd on one both need CUDA's device guard. Meta is the same test of "never reads the
  device": a meta tensor has no values either.)

What is measured, per rank (:class:`RankReport`):

- ``state_bytes``: every live meta storage after iteration 1 (parameters and their compute
  copies, gradient buffers and partitions, fp32 masters, optimizer state; anything else the
  run keeps between iterations counts too, which is the point);
- ``peak_bytes``: the live peak during iteration 2 (``LiveMemoryTracker`` on meta), split by
  ``peak_by_kind``: ``state`` (storages that existed when the iteration began), ``gathered``
  (storages regrown in place during it: ZeRO-3's gathered units), ``forward`` (allocated inside
  a module's forward: activations kept for backward, forward temporaries), ``backward``
  (allocated while autograd runs backward: gradients, recomputed activations, temporaries),
  ``other`` (everything else: loss, p2p buffers, gradient reduction, the optimizer step);
- ``sent_bytes``: bytes this rank sends in iteration 2 per group (``tp``, ``pp``, ``dp``,
  ``embedding``, and ``mp`` / ``world`` when used), from the ``c10d`` operators actually issued,
  with ring volumes: an all-reduce of B bytes over n ranks sends 2 B (n-1)/n, an all-gather
  or reduce-scatter of a full tensor of B bytes (and a broadcast, all-to-all, reduce, gather
  or scatter of B) sends B (n-1)/n, a send B, a receive nothing;
- ``host_reads``: where the loop read a device value during iteration 2 (``.item()``,
  ``.tolist()``, ``.cpu()``), by megazero source line: answered with zeros (a meta tensor has
  no value), on a GPU each one is a host synchronisation.

How the meta device stands in for a GPU (reads answered, meta kernels cached, flash attention
chosen as CUDA would): :mod:`megazero.utils.meta_device`. The rest of what differs from a GPU:
megazero picks its optimizer kernel by device type, and on meta that is torch's single-tensor
AdamW, whose temporaries (an fp32 copy or two of one master group while it is updated) a GPU's
fused kernel does not make; they show in ``peak_by_kind['other']`` when the step is the peak.
What a GPU run adds beyond the tensors is reported beside them, not measured: the NCCL
communicators this rank joins times an estimate per communicator from NCCL's defaults
(``nccl_communicators``, ``nccl_bytes``: :mod:`megazero.observe.gpu_overheads`). The offloads'
host bytes are exact on a GPU too (one exact-size allocation per offload object, registered with
``cudaHostRegister``, not rounded by torch's caching host allocator). The allocator's
fragmentation and the CUDA context are not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import sys
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from megazero.config.arguments import parse_args
from megazero.config.train_config import ConfigError, TrainConfig
from megazero.utils.output import RUN_LOGGERS, console

from .. import mpu
from ..utils.memory_tracker import LiveMemoryTracker
from ..utils.meta_device import MetaDeviceMode, cuda_kernels_on_meta
from .gpu_overheads import (
    HOST_MEMORY_NOTE,
    NCCL_COMMUNICATOR_BYTES,
    gradient_communicator_note,
    nccl_communicators,
    nccl_line,
)
from .planner import GiB
from .step_kinds import StepKinds

__all__ = ["RankReport", "rehearsal_config", "launch_line", "default_ranks", "sent_by_plan_group", "PLAN_GROUPS", "rehearse_rank", "rehearse", "format_report",
           "write_json", "REHEARSAL_ITERATIONS"]

REHEARSAL_ITERATIONS = 2  # iteration 1 settles the state (optimizer moments appear at the first step)
GROUP_NAMES = ("tp", "pp", "dp", "embedding")  # always reported; others only when used
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Frames of the measuring machinery, skipped when naming where a host read came from.
_MEASURING_FILES = tuple(os.path.join(_PACKAGE_DIR, *f) for f in (
    ("observe", "rehearsal.py"), ("utils", "memory_tracker.py"), ("utils", "meta_device.py"),
    ("observe", "step_kinds.py")))


@dataclasses.dataclass
class RankReport:
    """What one rehearsed rank holds and sends (bytes; iteration 2 unless said otherwise)."""

    rank: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    state_bytes: int  # live after iteration 1
    peak_bytes: int  # live peak during iteration 2
    peak_by_kind: dict[str, int]
    peak_at: str  # the megazero source line running when the peak was reached
    sent_bytes: dict[str, int]  # group -> bytes sent
    sent_by_op: dict[str, int]  # "group/op" -> bytes sent
    calls_by_op: dict[str, int]  # "group/op" -> collectives issued
    host_reads: dict[str, int]  # "file.py:line (function)" -> reads
    engine_state_bytes: int  # the ZeRO engine's own count of its parameters, gradients and optimizer state
    micro_batches: int  # per iteration
    seconds: float  # wall time of this rank's rehearsal
    plan: dict[str, float] = dataclasses.field(default_factory=dict)  # the planner's figures for this rank
    # Optimizer offload: the engine's host bytes (offloaded state in memory + the step's ring), which
    # the rehearsal holds as meta tensors too and takes out of state_bytes / peak_bytes; NVMe files apart.
    host_bytes: int = 0
    nvme_bytes: int = 0
    # On a GPU, beyond the tensors: the NCCL communicators of more than one rank this rank joins
    # (group name -> count) and their estimated device bytes (megazero.observe.gpu_overheads).
    nccl_communicators: dict[str, int] = dataclasses.field(default_factory=dict)
    nccl_bytes: int = 0
    nccl_note: str = ""
    cp_rank: int = 0  # this rank's place in its context-parallel group

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- configuration --------------------------------------------------------------------------


def rehearsal_config(argv: Sequence[str], world_size: int, micro_batches: Optional[int] = None, *,
                     parser: Optional[argparse.ArgumentParser] = None) -> tuple[TrainConfig, list[str]]:
    """``pretrain_gpt.py``'s flags for ``world_size`` ranks, parsed as it parses them for a plan
    (``parse_args(planning=True)``: file checks off, training-only flags optional; ``parser``: the
    tool's), then made a rehearsal: two iterations of the full global batch (or of ``micro_batches``
    per DP rank, when fewer) on synthetic tokens, no evaluation, checkpoints, loads, logs to
    files or early exits. Returns the config and one line per override."""
    argv = list(argv)
    if not any(a.split("=")[0] in ("--train-iters", "--train-samples") for a in argv):
        argv += ["--train-iters", str(REHEARSAL_ITERATIONS)]  # the length of the run is the rehearsal's anyway
    config = parse_args(argv, world_size, check_files=False, planning=True, parser=parser)
    notes: list[str] = [n for n in config.notes if n.startswith(("--micro-batch-size not given",))]
    s, d, ck, lg, m = config.schedule, config.data, config.checkpoint, config.logging, config.model

    def note(changed: bool, text: str) -> None:
        if changed:
            notes.append(text)

    note(s.train_iters != REHEARSAL_ITERATIONS, f"--train-iters {s.train_iters} -> {REHEARSAL_ITERATIONS}")
    note(s.rampup_batch_size is not None, "--rampup-batch-size dropped: every iteration takes the full global batch")
    note(bool(s.eval_iters and s.eval_interval), "evaluation off (--eval-iters 0)")
    note(s.skip_train, "--skip-train dropped")
    note(bool(s.exit_interval or s.exit_duration_in_mins or s.exit_signal_handler or s.train_tokens),
         "exit conditions dropped")
    if micro_batches is not None and 0 < micro_batches < s.grad_accum_steps:
        # A stage holds at most pp x v micro-batches in flight: the peak is that of the full batch once
        # micro_batches reaches it; what is sent per iteration scales with the count.
        notes.append(f"{micro_batches} of the global batch's {s.grad_accum_steps} micro-batches per iteration "
                     f"(--micro-batches): bytes sent are for {micro_batches}")
        s = dataclasses.replace(s, grad_accum_steps=micro_batches,
                                global_batch_size=micro_batches * s.micro_batch_size * config.parallel.dp)
    config.schedule = dataclasses.replace(
        s, train_iters=REHEARSAL_ITERATIONS, train_samples=REHEARSAL_ITERATIONS * s.global_batch_size,
        rampup_batch_size=None, eval_iters=0, eval_interval=0, skip_train=False, exit_interval=None,
        exit_duration_in_mins=None, exit_signal_handler=False, train_tokens=None)
    if not d.mock_data:
        if d.reset_position_ids or d.reset_attention_mask or d.eod_mask_loss:
            raise ConfigError("--reset-position-ids / --reset-attention-mask / --eod-mask-loss need an end-of-document "
                              "token: pass --mock-data with a tokenizer that needs no files (--tokenizer-type "
                              "NullTokenizer --vocab-size N) to rehearse them")
        notes.append("data: synthetic tokens (--mock-data) instead of the data path, no tokenizer "
                     f"(vocabulary {m.vocab_size}); the shapes are the same")
        config.data = dataclasses.replace(d, mock_data=True, tokenizer_type=None, data_path=[], prefixes=[],
                                          train_data_path=[], valid_data_path=[], test_data_path=[])
    note(bool(ck.save or ck.load or ck.pretrained),
         "no checkpoint saved or loaded (--save/--load/--pretrained dropped)")
    config.checkpoint = dataclasses.replace(ck, save=None, load=None, save_interval=None, pretrained=None,
                                            finetune=False)
    note(bool(lg.tensorboard_dir or lg.metrics_file or lg.wandb_project or lg.csv_dir),
         "no tensorboard, metrics file, wandb or csv output")
    # One log line, after iteration 2 has been measured (the log's loss read is not part of a step).
    config.logging = dataclasses.replace(lg, log_interval=REHEARSAL_ITERATIONS, tensorboard_dir=None, metrics_file=None,
                                         wandb_project=None, csv_dir=None, track_memory=False)
    config.generate = dataclasses.replace(config.generate, prompt=None)
    if m.attention_backend == "flash":
        notes.append("--use-flash-attn -> sdpa: flash-attn needs CUDA; the rehearsal runs the same kernel's memory")
        config.model = dataclasses.replace(m, attention_backend="sdpa")
    return config, notes


def launch_line(config: TrainConfig) -> str:
    """``64 ranks = tp 4 x cp 2 x pp 1 x dp 8 (experts: etp 1 x ep 8 x expert-dp 2), ZeRO-3, ...``."""
    p, s = config.parallel, config.schedule
    experts = (f" (experts: etp {p.etp} x ep {p.ep} x expert-dp {p.dp * p.cp * p.tp // (p.ep * p.etp)})"
               if p.ep > 1 or p.etp != p.tp else "")
    return (f"{p.world_size} ranks = tp {p.tp} x cp {p.cp} x pp {p.pp} x dp {p.dp}{experts}, ZeRO-{p.zero_stage}, "
            f"{config.precision.dtype}, micro-batch {s.micro_batch_size}, global batch {s.global_batch_size}")


def default_ranks(config: TrainConfig) -> list[int]:
    """One rank per distinct role: first and last pipeline stage x first and last DP rank, TP rank 0."""
    p = config.parallel
    out: list[int] = []
    for pp_rank in dict.fromkeys((0, p.pp - 1)):
        for dp_rank in dict.fromkeys((0, p.dp - 1)):
            r = (pp_rank * p.dp + dp_rank) * p.cp * p.tp  # cp rank 0, tp rank 0 (mpu.rank_layout's order)
            if r not in out:
                out.append(r)
    return out


# ---- what iteration 2 sends and reads ---------------------------------------------------------


def _ring_factor(n: int) -> float:
    return (n - 1) / n


def _all_reduce_factor(n: int) -> float:
    return 2 * (n - 1) / n


# c10d operator -> (index of the argument whose bytes define the volume, per-rank send factor of n).
_C10D_VOLUME: dict[str, tuple[int, Callable[[int], float]]] = {
    "allreduce_": (0, _all_reduce_factor), "allreduce_coalesced_": (0, _all_reduce_factor),
    "_allgather_base_": (0, _ring_factor), "allgather_": (0, _ring_factor),
    "allgather_coalesced_": (0, _ring_factor), "allgather_into_tensor_coalesced_": (0, _ring_factor),
    "_reduce_scatter_base_": (1, _ring_factor), "reduce_scatter_": (1, _ring_factor),
    "reduce_scatter_tensor_coalesced_": (1, _ring_factor),
    "broadcast_": (0, _ring_factor), "alltoall_base_": (1, _ring_factor), "alltoall_": (1, _ring_factor),
    "reduce_": (0, _ring_factor), "gather_": (1, _ring_factor), "scatter_": (1, _ring_factor),
    "send": (0, lambda n: 1.0),
}


def _nbytes(x: Any) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


def _caller() -> str:
    """The innermost megazero frame (outside the measuring code) that is running: where a read was made."""
    f = sys._getframe(1)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(_PACKAGE_DIR) and path not in _MEASURING_FILES:
            return f"{os.path.relpath(path, _PACKAGE_DIR)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "outside megazero"


class _Counters:
    """What iteration 2 does on the wire and on the host: bytes each collective sends, by
    megazero group name (:data:`_C10D_VOLUME`), and where device values were read."""

    def __init__(self) -> None:
        self.counting = False
        self.host_reads: dict[str, int] = {}
        self.sent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._names: dict[int, str] = {}

    def start(self) -> None:
        self.host_reads, self.sent, self.calls, self.counting = {}, {}, {}, True

    def on_read(self) -> None:
        if self.counting:
            where = _caller()
            self.host_reads[where] = self.host_reads.get(where, 0) + 1

    def _group_name(self, pg: dist.ProcessGroup) -> str:
        if not self._names:
            g = mpu.get_parallel_groups()
            for name, group in (("tp", g.tp_group), ("pp", g.pp_group), ("dp", g.dp_group),
                                ("embedding", g.embedding_group), ("mp", g.mp_group),
                                ("position_embedding", g.position_embedding_group), ("cp", g.cp_group),
                                ("dp_cp", g.dp_cp_group), ("hcp_a2a", g.hcp_a2a_group),
                                ("hcp_p2p", g.hcp_p2p_group), ("ep", g.ep_group), ("edp", g.edp_group),
                                ("etp", g.etp_group), ("expert", g.expert_group)):
                if group is not None:
                    self._names.setdefault(id(group), name)
            self._names.setdefault(id(dist.group.WORLD), "world")
        if id(pg) not in self._names:  # a communicator of its own over a named group's ranks (ZeRO-3's gradients)
            g, name = mpu.get_parallel_groups(), "other"
            try:
                ranks = dist.get_process_group_ranks(pg)
                name = next((n for n, grp in (("dp", g.dp_group), ("dp_cp", g.dp_cp_group), ("tp", g.tp_group),
                                              ("pp", g.pp_group), ("cp", g.cp_group))
                             if grp is not None and dist.get_process_group_ranks(grp) == ranks), "other")
            except (RuntimeError, ValueError, KeyError, TypeError):
                pass
            self._names[id(pg)] = name
        return self._names[id(pg)]

    def on_collective(self, func, args: tuple) -> None:
        if not self.counting:
            return
        pg = next((a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())), None)
        if pg is None:
            return
        group = dist.ProcessGroup.unbox(pg)
        op = func._overloadpacket.__name__
        key = f"{self._group_name(group)}/{op.strip('_')}"
        self.calls[key] = self.calls.get(key, 0) + 1
        rule, n = _C10D_VOLUME.get(op), group.size()
        if rule is not None and n > 1:
            self.sent[key] = self.sent.get(key, 0.0) + _nbytes(args[rule[0]]) * rule[1](n)


# ---- one rank ---------------------------------------------------------------------------------


def rehearse_rank(config: TrainConfig, rank: int, *, log: Optional[io.TextIOBase] = None,
                  cache_kernels: bool = True) -> RankReport:
    """Run ``rank`` of ``config``'s launch through :func:`pretrain` on the meta device and a fake
    process group (started and destroyed here); its output goes to ``log`` (default: discarded).
    ``cache_kernels=False`` runs every meta kernel (slower; the figures are the same)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..training.loop import Callback
    from ..training.trainer import pretrain

    p = config.parallel
    if not 0 <= rank < p.world_size:
        raise ValueError(f"rank {rank} is outside the world of {p.world_size} ranks")
    t0 = time.perf_counter()
    measured: dict[str, Any] = {}
    counters, phases = _Counters(), StepKinds()
    device_mode = MetaDeviceMode(cache=cache_kernels, on_read=counters.on_read, on_collective=counters.on_collective)
    cpu_rng = torch.get_rng_state()
    # Every storage the run makes is a meta one made while this tracker runs: no baseline scan.
    tracker = LiveMemoryTracker("meta", scan_existing=False, kind_of=phases.kind_of, where=_caller)

    class Measure(Callback):
        """The state after iteration 1 and the peak of iteration 2; the collectives of iteration 2."""

        def on_train_start(self, state, run) -> None:
            self.run = run

        def on_step_end(self, state, result) -> None:
            measure(state.iteration, self.run)

    def measure(iteration: int, run) -> None:
        if iteration == 1:
            counted = run.engine.model_state_bytes()
            # Offloaded state and the ring are meta tensors here too; on a GPU they are host memory
            # (the parameter partitions bound for NVMe as well: rehearsed, they are not written).
            measured["host"] = sum(counted.get(k, 0) for k in ("host_optimizer", "host_ring", "host_params",
                                                               "host_param_ring"))
            measured["nvme"] = counted.get("nvme", 0) + counted.get("nvme_params", 0)
            measured["state"] = tracker.absolute_current_bytes - measured["host"] - counted.get("nvme_params", 0)
            measured["off_device"] = measured["host"] + counted.get("nvme_params", 0)
            measured["engine_state"] = counted["total"]
            tracker.reset_peak(relabel="state")
            counters.start()
        elif iteration == 2:
            counters.counting = False
            kinds = dict(tracker.peak_by_kind)
            kinds["state"] = kinds.get("state", 0) - measured["off_device"]
            measured["peak"], measured["peak_by_kind"] = tracker.absolute_peak_bytes - measured["off_device"], kinds
            measured["peak_at"] = tracker.peak_where or "before iteration 2 (its state)"

    out = log or io.StringIO()
    # One fake group serves the host tensors (agreement flags) and the meta ones.
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=p.world_size)
    try:
        # The loop logs its lines (rank 0's) through megazero.training's loggers: shown on the
        # redirected stdout with what it prints, so they go to ``log`` and nowhere else.
        with contextlib.redirect_stdout(out), console(*RUN_LOGGERS), phases, device_mode, tracker, \
                cuda_kernels_on_meta():
            pretrain(config, device=torch.device("meta"), callbacks=[Measure()])
        groups = mpu.get_parallel_groups()
    except BaseException as e:
        if log is None:  # what the run printed before it failed
            sys.stderr.write(out.getvalue()[-4000:])
        e.add_note(f"while rehearsing rank {rank} of {p.world_size}")
        raise
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()
        torch.set_rng_state(cpu_rng)
    if "peak" not in measured:
        raise RuntimeError(f"rank {rank}: the run stopped before iteration {REHEARSAL_ITERATIONS} ended")
    sent = {name: 0 for name in GROUP_NAMES}
    for key, value in counters.sent.items():
        sent[key.split("/")[0]] = sent.get(key.split("/")[0], 0) + int(value)
    return RankReport(
        rank=rank, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, dp_rank=groups.dp_rank, cp_rank=groups.cp_rank,
        state_bytes=measured["state"], peak_bytes=measured["peak"], peak_by_kind=measured["peak_by_kind"],
        peak_at=measured["peak_at"],
        sent_bytes=sent, sent_by_op={k: int(v) for k, v in sorted(counters.sent.items())},
        calls_by_op=dict(sorted(counters.calls.items())), host_reads=counters.host_reads,
        engine_state_bytes=measured["engine_state"], host_bytes=measured["host"], nvme_bytes=measured["nvme"],
        micro_batches=config.schedule.grad_accum_steps,
        seconds=round(time.perf_counter() - t0, 2), plan=plan_for_rank(config, groups.pp_rank),
        **nccl_for_rank(config, groups.pp_rank))


def rehearse(config: TrainConfig, ranks: Sequence[int], *, log: Optional[io.TextIOBase] = None,
             on_rank: Optional[Callable[[RankReport], None]] = None) -> list[RankReport]:
    """:func:`rehearse_rank` for each of ``ranks`` in turn (``on_rank`` sees each report as it comes)."""
    if dist.is_initialized():
        raise RuntimeError("torch.distributed is already initialized in this process: a rehearsal starts its own "
                           "fake process group for every rank")
    reports = []
    for r in ranks:
        reports.append(rehearse_rank(config, r, log=log))
        if on_rank is not None:
            on_rank(reports[-1])
    return reports


# ---- output -----------------------------------------------------------------------------------


def _size(n: float) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", 2 ** 20), ("KiB", 2 ** 10)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


# The plan's traffic groups (planner.TRAFFIC_LABELS) as the rehearsal's groups name them.
PLAN_GROUPS = {"dp": ("dp", "dp_cp"), "edp": ("edp",), "tp": ("tp",), "cp": ("cp", "hcp_a2a", "hcp_p2p"),
               "ep": ("ep", "expert"), "pp": ("pp",)}


def sent_by_plan_group(report: "RankReport") -> dict[str, int]:
    """The bytes ``report``'s rank sent, summed into the planner's groups (:data:`PLAN_GROUPS`)."""
    return {key: sum(report.sent_bytes.get(g, 0) for g in groups) for key, groups in PLAN_GROUPS.items()}


def plan_for_rank(config: TrainConfig, pp_rank: int) -> dict[str, float]:
    """The analytic plan (``planner.estimate_memory_for``, what ``tools/estimate_memory.py`` and the
    start-up line print) for a rank of pipeline stage ``pp_rank``: its model state, its peak and the
    bytes it sends per planned group (``sent_dp``, ``sent_edp``, ``sent_tp``, ``sent_cp``, ``sent_ep``,
    ``sent_pp``: its stage's, for the micro-batches rehearsed)."""
    from .planner import estimate_memory_for

    est = estimate_memory_for(config)
    stages = est.pipeline.get("stages")
    offloads = est.plan.get("offload_optimizer", "none") != "none" or est.plan.get("offload_param", "none") != "none"
    host = {"host_bytes": est.host_total} if offloads else {}
    st = stages[pp_rank] if stages else None
    traffic = st["traffic"] if st else est.traffic
    sent = {f"sent_{key}": float(traffic[key]) for key in PLAN_GROUPS}
    if st is None:
        return {"state_bytes": est.model_states, "peak_bytes": est.total, **host, **sent}
    return {"state_bytes": float(sum(st["states"])), "peak_bytes": float(st["total"]), **host, **sent}


def nccl_for_rank(config: TrainConfig, pp_rank: int) -> dict[str, Any]:
    """The NCCL communicators a rank of pipeline stage ``pp_rank`` joins on a GPU and their estimated
    bytes (:func:`megazero.observe.gpu_overheads.nccl_communicators`): :class:`RankReport`'s fields."""
    p = config.parallel
    keep = config.zero_config().zero_optimization.stage3_keep_gathered_in_step
    comms = nccl_communicators(tp=p.tp, pp=p.pp, dp=p.dp, cp=p.cp, zero_stage=p.zero_stage, keep_gathered=keep,
                               pp_rank=pp_rank, hierarchical_cp=p.hierarchical_cp, ep=p.ep, etp=p.etp)
    return {"nccl_communicators": comms, "nccl_bytes": sum(comms.values()) * NCCL_COMMUNICATOR_BYTES,
            "nccl_note": gradient_communicator_note(comms, p.zero_stage, p.dp * p.cp)}


def format_report(r: RankReport) -> str:
    """A few readable lines for one rank."""
    kinds = " + ".join(f"{k} {_size(v)}" for k, v in sorted(r.peak_by_kind.items(), key=lambda kv: -kv[1]))
    mbs = f"{r.micro_batches} micro-batch{'es' if r.micro_batches > 1 else ''}"
    cp = f", cp {r.cp_rank}" if r.cp_rank or "cp" in r.nccl_communicators else ""
    lines = [f"rank {r.rank} (tp {r.tp_rank}{cp}, pp {r.pp_rank}, dp {r.dp_rank}): {mbs} per iteration, "
             f"rehearsed in {r.seconds:.1f} s",
             f"  state after iteration 1    {_size(r.state_bytes):>11}   (the ZeRO engine's own count: "
             f"{_size(r.engine_state_bytes)})",
             f"  peak in iteration 2        {_size(r.peak_bytes):>11}   = {kinds}",
             f"    reached in {r.peak_at}"]
    if r.host_bytes or r.nvme_bytes:
        planned = f"; the plan: {_size(r.plan['host_bytes'])}" if "host_bytes" in r.plan else ""
        lines.append(f"  host memory (offload)      {_size(r.host_bytes):>11}   (offloaded state and the step's "
                     f"ring{planned})" + (f"; NVMe files {_size(r.nvme_bytes)}" if r.nvme_bytes else ""))
        lines.append(f"    ({HOST_MEMORY_NOTE})")
    lines.append(f"  on a GPU, {nccl_line(r.nccl_communicators, r.nccl_note)}: peak + NCCL "
                 f"{_size(r.peak_bytes + r.nccl_bytes)}")
    if r.plan:
        lines.append(f"  the plan (tools/estimate_memory.py): state {_size(r.plan['state_bytes'])}, peak "
                     f"{_size(r.plan['peak_bytes'])}; rehearsed / plan: state "
                     f"{r.state_bytes / r.plan['state_bytes']:.2f}x, peak {r.peak_bytes / r.plan['peak_bytes']:.2f}x")
    if "sent_dp" in r.plan:
        measured = sent_by_plan_group(r)
        lines.append("  the plan's bytes sent (tools/estimate_memory.py), rehearsed / plan: " + ", ".join(
            f"{key} {_size(r.plan['sent_' + key])} ({measured[key] / r.plan['sent_' + key]:.2f}x)"
            for key in PLAN_GROUPS if r.plan["sent_" + key] or measured[key]))
    for group, total in r.sent_bytes.items():
        ops = ", ".join(f"{k.split('/')[1]} {_size(v)} ({r.calls_by_op[k]}x)" for k, v in r.sent_by_op.items()
                        if k.split("/")[0] == group)
        per_mb = f" ({_size(total / r.micro_batches)} per micro-batch)" if total and r.micro_batches > 1 else ""
        lines.append(f"  sent, {group:<20}{_size(total):>11}{per_mb}" + (f": {ops}" if ops else ""))
    lines.append(f"  host reads in iteration 2  {sum(r.host_reads.values()):>7}"
                 + "".join(f"\n    {n} x {where}" for where, n in r.host_reads.items()))
    return "\n".join(lines)


def write_json(path: str, reports: Sequence[RankReport], config: TrainConfig, notes: Sequence[str]) -> None:
    p = config.parallel
    doc = {"world_size": p.world_size, "tp": p.tp, "cp": p.cp, "pp": p.pp, "dp": p.dp, "ep": p.ep, "etp": p.etp,
           "zero_stage": p.zero_stage,
           "iterations": REHEARSAL_ITERATIONS, "notes": list(notes), "ranks": [r.to_json() for r in reports]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
