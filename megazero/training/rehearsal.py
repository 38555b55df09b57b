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
  ``.tolist()``, ``.cpu()``), by megazero source line. A meta tensor has no value; such a read
  is answered with zeros (so a gradient norm reads 0 and an agreement flag "no") and counted:
  on a GPU each one is a host synchronisation.

The rehearsal's device stands for a GPU in one more way: ``scaled_dot_product_attention`` on
meta tensors without a mask runs the kernel CUDA picks (flash attention, with its memory:
output and log-sum-exp, no s x s scores) instead of the math fallback meta would decompose to.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import sys
import time
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .. import mpu
from ..utils.memory_tracker import LiveMemoryTracker
from .arguments import parse_args
from .config import ConfigError, TrainConfig
from .memory import GiB

__all__ = ["RankReport", "rehearsal_config", "default_ranks", "rehearse_rank", "rehearse", "format_report",
           "write_json", "REHEARSAL_ITERATIONS"]

REHEARSAL_ITERATIONS = 2  # iteration 1 settles the state (optimizer moments appear at the first step)
GROUP_NAMES = ("tp", "pp", "dp", "embedding")  # always reported; others only when used
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Frames of the measuring machinery, skipped when naming where a host read came from.
_MEASURING_FILES = (os.path.abspath(__file__), os.path.join(_PACKAGE_DIR, "utils", "memory_tracker.py"))


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
    sent_bytes: dict[str, int]  # group -> bytes sent
    sent_by_op: dict[str, int]  # "group/op" -> bytes sent
    calls_by_op: dict[str, int]  # "group/op" -> collectives issued
    host_reads: dict[str, int]  # "file.py:line (function)" -> reads
    engine_state_bytes: int  # the ZeRO engine's own count of its parameters, gradients and optimizer state
    micro_batches: int  # per iteration
    seconds: float  # wall time of this rank's rehearsal

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---- configuration --------------------------------------------------------------------------


def rehearsal_config(argv: Sequence[str], world_size: int) -> tuple[TrainConfig, list[str]]:
    """``pretrain_gpt.py``'s flags for ``world_size`` ranks, parsed as it parses them (file checks
    off), then made a rehearsal: two iterations of the full global batch on synthetic tokens, no
    evaluation, checkpoints, loads, logs to files or early exits. Returns the config and one
    line per override."""
    argv = list(argv)
    if not any(a.split("=")[0] in ("--train-iters", "--train-samples") for a in argv):
        argv += ["--train-iters", str(REHEARSAL_ITERATIONS)]  # the length of the run is the rehearsal's anyway
    config = parse_args(argv, world_size, check_files=False)
    notes: list[str] = []
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
    note(bool(ck.save or ck.load or ck.pretrained), "no checkpoint saved or loaded (--save/--load/--pretrained dropped)")
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


def default_ranks(config: TrainConfig) -> list[int]:
    """One rank per distinct role: first and last pipeline stage x first and last DP rank, TP rank 0."""
    p = config.parallel
    out: list[int] = []
    for pp_rank in dict.fromkeys((0, p.pp - 1)):
        for dp_rank in dict.fromkeys((0, p.dp - 1)):
            r = pp_rank * p.dp * p.tp + dp_rank * p.tp
            if r not in out:
                out.append(r)
    return out


# ---- what the rehearsal's device does -------------------------------------------------------


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
    f = sys._getframe(2)
    while f is not None:
        path = os.path.abspath(f.f_code.co_filename)
        if path.startswith(_PACKAGE_DIR) and path not in _MEASURING_FILES:
            return f"{os.path.relpath(path, _PACKAGE_DIR)}:{f.f_lineno} ({f.f_code.co_name})"
        f = f.f_back
    return "outside megazero"


_UNCACHEABLE = object()


class _MetaKernelCache:
    """Output metadata of meta kernels, by operator and input metadata (FakeTensorMode keeps the
    same cache): most of torch's meta kernels are Python (type promotion and strides for every
    elementwise op, 0.1-1.5 ms each), and a training step repeats the same few hundred calls
    per layer and micro-batch. Only operators that mutate nothing and return new tensors, all
    of their tensors on meta, are cached; their outputs are made anew with ``empty_strided``
    (the same shapes, strides, dtypes and storage sizes as the kernel's)."""

    def __init__(self) -> None:
        self.entries: dict[tuple, Any] = {}
        self._eligible: dict[Any, bool] = {}
        self.hits = self.misses = 0

    def eligible(self, func) -> bool:
        ok = self._eligible.get(func)
        if ok is None:
            schema = func._schema
            ok = func.namespace == "aten" and not schema.is_mutable and all(
                r.alias_info is None for r in schema.returns) and func is not torch.ops.aten._local_scalar_dense.default
            self._eligible[func] = ok
        return ok

    @staticmethod
    def _key(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if not x.is_meta:
                raise _NotCacheable
            return (x.dtype, tuple(x.shape), x.stride(), x.storage_offset())
        if isinstance(x, (list, tuple)):
            return tuple(_MetaKernelCache._key(v) for v in x)
        if x is None or isinstance(x, (bool, int, float, str, torch.dtype, torch.device, torch.layout,
                                       torch.memory_format)):
            return (type(x), x)
        raise _NotCacheable

    def run(self, func, args: tuple, kwargs: dict) -> Any:
        try:
            key = (func, self._key(args), self._key(tuple(sorted(kwargs.items()))))
        except _NotCacheable:
            return func(*args, **kwargs)
        entry = self.entries.get(key)
        if entry is _UNCACHEABLE:
            return func(*args, **kwargs)
        if entry is not None:
            self.hits += 1
            return _rebuild(entry)
        out = func(*args, **kwargs)
        self.misses += 1
        try:
            entry = _describe(out)
            again = _rebuild(entry)
            if _storage_sizes(again) != _storage_sizes(out):
                raise _NotCacheable
        except _NotCacheable:
            entry = _UNCACHEABLE
        self.entries[key] = entry
        return out


class _NotCacheable(Exception):
    pass


def _describe(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        if not out.is_meta or out.is_sparse:
            raise _NotCacheable
        return ("T", tuple(out.shape), out.stride(), out.dtype, out.storage_offset(), out.untyped_storage().nbytes())
    if isinstance(out, (list, tuple)):
        return (type(out), tuple(_describe(o) for o in out))
    if out is None or isinstance(out, (bool, int, float)):
        return ("V", out)
    raise _NotCacheable


def _rebuild(entry: Any) -> Any:
    if entry[0] == "T":
        _, shape, stride, dtype, offset, nbytes = entry
        t = torch.empty_strided(shape, stride, dtype=dtype, device="meta")
        if offset == 0 and t.untyped_storage().nbytes() == nbytes:
            return t
        return torch.empty(nbytes // dtype.itemsize, dtype=dtype, device="meta").as_strided(shape, stride, offset)
    if entry[0] == "V":
        return entry[1]
    kind, items = entry
    return kind(_rebuild(e) for e in items)


def _storage_sizes(out: Any) -> list[int]:
    if isinstance(out, torch.Tensor):
        return [out.untyped_storage().nbytes()]
    if isinstance(out, (list, tuple)):
        return [n for o in out for n in _storage_sizes(o)]
    return []


class _MetaDevice(TorchDispatchMode):
    """Answers reads of meta values with zeros (counting where they come from), counts the
    bytes every collective sends, by megazero group name (both only while ``counting``), and
    runs meta kernels through :class:`_MetaKernelCache` (with ``cache``)."""

    def __init__(self, cache: bool = True) -> None:
        super().__init__()
        self.cache = _MetaKernelCache() if cache else None
        self.counting = False
        self.host_reads: dict[str, int] = {}
        self.sent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self._names: dict[int, str] = {}

    def reset(self) -> None:
        self.host_reads, self.sent, self.calls = {}, {}, {}

    def _group_name(self, pg: dist.ProcessGroup) -> str:
        if not self._names:
            if mpu.model_parallel_is_initialized():
                g = mpu.get_parallel_groups()
                for name, group in (("tp", g.tp_group), ("pp", g.pp_group), ("dp", g.dp_group),
                                    ("embedding", g.embedding_group), ("mp", g.mp_group),
                                    ("position_embedding", g.position_embedding_group)):
                    if group is not None:
                        self._names.setdefault(id(group), name)
            self._names.setdefault(id(dist.group.WORLD), "world")
        return self._names.get(id(pg), "other")

    def _read(self, value: Any) -> Any:
        if self.counting:
            where = _caller()
            self.host_reads[where] = self.host_reads.get(where, 0) + 1
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default and args[0].is_meta:  # .item(), float(), bool()
            dtype = args[0].dtype
            return self._read(False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0)
        if func is torch.ops.aten._to_copy.default and args[0].is_meta:  # .cpu(), .tolist()
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "meta":
                return self._read(torch.zeros(args[0].shape, dtype=kwargs.get("dtype") or args[0].dtype, device=device))
        if func is torch.ops.aten.copy_.default and args[1].is_meta and not args[0].is_meta:
            return self._read(args[0].zero_())
        if func.namespace == "c10d":
            if self.counting:
                self._count(func, args)
        elif self.cache is not None and self.cache.eligible(func):
            return self.cache.run(func, args, kwargs)
        return func(*args, **kwargs)

    def _count(self, func, args) -> None:
        pg = next((a for a in args if isinstance(a, torch.ScriptObject) and "ProcessGroup" in str(a._type())), None)
        if pg is None:
            return
        group = dist.ProcessGroup.unbox(pg)
        name, op = self._group_name(group), func._overloadpacket.__name__
        key = f"{name}/{op.strip('_')}"
        self.calls[key] = self.calls.get(key, 0) + 1
        rule = _C10D_VOLUME.get(op)
        n = group.size()
        if rule is not None and n > 1:
            index, factor = rule
            self.sent[key] = self.sent.get(key, 0.0) + _nbytes(args[index]) * factor(n)


@contextlib.contextmanager
def _cuda_attention() -> Iterator[None]:
    """While active, ``scaled_dot_product_attention`` on meta tensors runs the kernel CUDA picks:
    flash attention (its meta kernel and backward: output and log-sum-exp, no s x s scores) for
    unmasked fp16/bf16 inputs, instead of the math decomposition meta falls back to. Other
    inputs keep the math path. Registered for meta's autograd key, so it holds in backward too
    (activation recomputation), and removed on exit."""
    lib = torch.library.Library("aten", "IMPL")

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        if attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and not enable_gqa:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                      scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal,
                                                                 scale=scale, enable_gqa=enable_gqa)[0]

    lib.impl("scaled_dot_product_attention", sdpa, "AutogradMeta")
    try:
        yield
    finally:
        lib._destroy()


class _Phases:
    """Labels an allocation by what is running: autograd's backward, a module's forward (with or
    without gradients: recomputed layers run their first forward without), or something else."""

    def __init__(self) -> None:
        self.depth = 0
        self.handles: list = []

    def __enter__(self) -> "_Phases":
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook

        self.handles = [register_module_forward_pre_hook(self._enter),
                        register_module_forward_hook(self._leave, always_call=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self.handles:
            h.remove()

    def _enter(self, module, args) -> None:
        self.depth += 1

    def _leave(self, module, args, out) -> None:
        self.depth -= 1

    def kind_of(self, event: str) -> str:
        if event == "resize":
            return "gathered"
        if torch._C._current_graph_task_id() != -1:
            return "backward"
        return "forward" if self.depth > 0 else "other"


# ---- one rank ---------------------------------------------------------------------------------


def rehearse_rank(config: TrainConfig, rank: int, *, log: Optional[io.TextIOBase] = None,
                  cache_kernels: bool = True) -> RankReport:
    """Run ``rank`` of ``config``'s launch through :func:`pretrain` on the meta device and a fake
    process group (started and destroyed here); its output goes to ``log`` (default: discarded).
    ``cache_kernels=False`` runs every meta kernel (slower; the figures are the same)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from .trainer import pretrain

    p = config.parallel
    if not 0 <= rank < p.world_size:
        raise ValueError(f"rank {rank} is outside the world of {p.world_size} ranks")
    t0 = time.perf_counter()
    measured: dict[str, Any] = {}
    device_mode, phases = _MetaDevice(cache=cache_kernels), _Phases()
    cpu_rng = torch.get_rng_state()
    # Every storage the run makes is a meta one made while this tracker runs: no baseline scan.
    tracker = LiveMemoryTracker("meta", scan_existing=False, kind_of=phases.kind_of)

    def on_iteration_end(iteration: int, run) -> None:
        if iteration == 1:
            measured["state"] = tracker.absolute_current_bytes
            measured["engine_state"] = run.engine.model_state_bytes()["total"]
            tracker.reset_peak(relabel="state")
            device_mode.reset()
            device_mode.counting = True
        elif iteration == 2:
            device_mode.counting = False
            measured["peak"], measured["peak_by_kind"] = tracker.absolute_peak_bytes, tracker.peak_by_kind

    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=rank, world_size=p.world_size)
    try:
        with contextlib.redirect_stdout(log or io.StringIO()), phases, device_mode, tracker, _cuda_attention():
            pretrain(config, device=torch.device("meta"), on_iteration_end=on_iteration_end)
        groups = mpu.get_parallel_groups()
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()
        torch.set_rng_state(cpu_rng)
    if "peak" not in measured:
        raise RuntimeError(f"rank {rank}: the run stopped before iteration {REHEARSAL_ITERATIONS} ended")
    sent = {name: 0 for name in GROUP_NAMES}
    for key, value in device_mode.sent.items():
        sent[key.split("/")[0]] = sent.get(key.split("/")[0], 0) + int(value)
    return RankReport(
        rank=rank, tp_rank=groups.tp_rank, pp_rank=groups.pp_rank, dp_rank=groups.dp_rank,
        state_bytes=measured["state"], peak_bytes=measured["peak"], peak_by_kind=measured["peak_by_kind"],
        sent_bytes=sent, sent_by_op={k: int(v) for k, v in sorted(device_mode.sent.items())},
        calls_by_op=dict(sorted(device_mode.calls.items())), host_reads=device_mode.host_reads,
        engine_state_bytes=measured["engine_state"], micro_batches=config.schedule.grad_accum_steps,
        seconds=round(time.perf_counter() - t0, 2))


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


def format_report(r: RankReport) -> str:
    """A few readable lines for one rank."""
    kinds = " + ".join(f"{k} {_size(v)}" for k, v in sorted(r.peak_by_kind.items(), key=lambda kv: -kv[1]))
    lines = [f"rank {r.rank} (tp {r.tp_rank}, pp {r.pp_rank}, dp {r.dp_rank}): {r.micro_batches} micro-batches "
             f"per iteration, rehearsed in {r.seconds:.1f} s",
             f"  state after iteration 1    {_size(r.state_bytes):>11}   (the ZeRO engine's own count: "
             f"{_size(r.engine_state_bytes)})",
             f"  peak in iteration 2        {_size(r.peak_bytes):>11}   = {kinds}"]
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
    doc = {"world_size": p.world_size, "tp": p.tp, "pp": p.pp, "dp": p.dp, "zero_stage": p.zero_stage,
           "iterations": REHEARSAL_ITERATIONS, "notes": list(notes), "ranks": [r.to_json() for r in reports]}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
