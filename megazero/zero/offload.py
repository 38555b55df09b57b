"""ZeRO-Offload and ZeRO-Infinity for the optimizer: fp32 masters and Adam moments on the host or NVMe.

What moves. ``ratio`` of this rank's partition (whole flat groups, in model order, as DeepSpeed's
partial offload and Megatron's ``--optimizer-offload-fraction``) is offloaded: for each offloaded
group the host keeps the fp32 master and Adam's two moments, 12 bytes per element, in host memory
(``device: cpu``) or in three files under ``nvme_path`` (``device: nvme``). The accelerator keeps
only what forward and backward use: the compute-dtype parameters (or their ZeRO-3 partition) and
the gradient partition. Mixed-precision training drops from 16 to 4 bytes per parameter partition
on the accelerator (fp32 training from 16 to 8: its parameters are fp32).

The step. The norm is computed on the accelerator, where the gradients are (the engine's one
all-reduce and one host read); then every offloaded group is streamed in chunks (:func:`ring_chunk`:
``buffer_size`` elements when given, rounded down to a multiple of :data:`ALIGN`; by default a
fixed :data:`DEFAULT_CHUNK`, smaller where the ring would exceed :data:`RING_SHARE` of the
offloaded state) through a ring of ``buffer_count`` host buffers, in three stages:

* fetch (reader thread): the chunk's gradient, accelerator -> ring slot; with NVMe also the master
  and moments, file -> slot;
* step (the caller's thread): one multiply by the coefficient the norm gave (unscale, clip), then
  torch's fused CPU Adam/AdamW on the chunk;
* return (writer thread): the updated weights in the compute dtype, slot -> accelerator; with NVMe
  also the state, slot -> file (plain ``pwrite``: no native build, no libaio).

While chunk i steps, chunk i+1 arrives and chunk i-1 leaves. On CUDA both threads are bound to the
rank's device (:func:`bind_device`) and copy on streams of their own, after an event the step's stream
records when the step begins (the gradients and weights as it left them), each waiting for its own
copy before the host touches the slot. A slot is refilled only after its return finished, so at most ``buffer_count`` chunks are in flight and host memory beyond the state
is the ring: ``buffer_count x chunk x 4`` bytes (the gradient) with ``cpu``, ``x 16`` with ``nvme``
(gradient, master, two moments). Sized by default from what is offloaded, not from the largest
group, the ring stays a small share of the state it streams at any model size, so offloading
saves most of what it moves.

Exactness. The fused CPU kernel is elementwise; chunks starting at multiples of :data:`ALIGN`
elements give bit-identical results to one call over the whole partition, so on a CPU machine a
run with offload equals the run without it (whose CPU masters use the same kernel). On a GPU the
accelerator's kernel (apex or torch CUDA) and the CPU kernel may round differently (about 1e-7 per
step).

Whole-tensor access outside the step (checkpoint save and load, loading pretrained weights)
goes through the same objects the engine always uses: ``group.master`` and the optimizer's state
are host tensors (``cpu``) or shared memory maps of the files (``nvme``), so every checkpoint and
load path works unchanged, and a model-only load writes the offloaded masters themselves.
:meth:`OptimizerOffload.drop_pages` unmaps the pages such an access touched.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import fcntl
import gc
import mmap
import os
import re
import time
import weakref
from typing import Callable, Optional

import torch

from .config import OffloadOptimizerConfig, OptimizerConfig
from .flat import FlatGroup
from .pinned import HostArena

__all__ = ["ALIGN", "DEFAULT_CHUNK", "RING_SHARE", "OptimizerOffload", "offloaded_groups", "ring_chunk"]

# Chunks start at multiples of this many elements: the fused CPU kernel's vectorised body then
# covers the same elements as in one call over the whole tensor (an unaligned start moves
# elements between its vector body and its scalar tail, which round differently).
ALIGN = 4096
# Elements per ring buffer when buffer_size is not given: large enough that a chunk's fixed costs
# (a thread hand-off, three file calls) are small beside its copies and its Adam.
DEFAULT_CHUNK = 1 << 20
# By default the ring holds at most this share of the offloaded state's bytes (12 per element).
RING_SHARE = 1 / 8


def ring_chunk(offloaded: int, largest: int, buffer_count: int, buffer_size: Optional[int], nvme: bool) -> int:
    """Elements per ring buffer for ``offloaded`` elements of optimizer state whose largest group
    has ``largest``: ``buffer_size`` when given (rounded down to a multiple of :data:`ALIGN`, at
    least ALIGN); else :data:`DEFAULT_CHUNK`, lowered so that the ``buffer_count`` buffers (4 B per
    element, x4 with ``nvme``) hold at most :data:`RING_SHARE` of the state's 12 B per element.
    Never more than ``largest`` rounded up to ALIGN, nor less than ALIGN."""
    if buffer_size is not None:
        chunk = max(ALIGN, int(buffer_size) // ALIGN * ALIGN)
    else:
        per_element = buffer_count * 4 * (4 if nvme else 1)  # ring bytes per element of a chunk
        cap = int(12 * offloaded * RING_SHARE) // per_element
        chunk = max(ALIGN, min(DEFAULT_CHUNK, cap) // ALIGN * ALIGN)
    return min(chunk, -(-max(int(largest), 1) // ALIGN) * ALIGN)
_STATE_KEYS = ("exp_avg", "exp_avg_sq")


def offloaded_groups(groups: list[FlatGroup], ratio: float) -> list[FlatGroup]:
    """The groups whose optimizer state is offloaded: the first ones in model order until
    ``ratio`` of the elements are covered (a group is offloaded whole or not at all)."""
    total = sum(g.shard_numel for g in groups)
    chosen, covered = [], 0
    for g in groups:
        if g.shard_numel == 0 or covered >= ratio * total - 1e-9 * total:
            continue
        chosen.append(g)
        covered += g.shard_numel
    return chosen


def claim_directory(root: str, rank: int, sub: str = "", key: str = "offload_optimizer") -> tuple[str, int]:
    """This rank's directory under ``root`` (``megazero_offload/rankNNNNN[/sub]``), locked; refuses
    one that another live process uses (two jobs sharing a path would overwrite each other's state).
    Returns the directory and the lock's descriptor (closing it releases the lock)."""
    directory = os.path.join(root, "megazero_offload", f"rank{rank:05d}", sub)
    os.makedirs(directory, exist_ok=True)
    fd = os.open(os.path.join(directory, "lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            # An engine of this process that is gone but not yet collected may still hold it (its
            # finalizer closes the lock): collect, and try once more.
            gc.collect()
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        raise RuntimeError(f"{key}.nvme_path: {directory} is in use by another process; give each "
                           "concurrent job its own nvme_path") from None
    return directory, fd


def file_name(g: FlatGroup) -> str:
    """A stable file-name stem for ``g`` on this rank: its first parameter and its partition's start."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", g.slots[0].name)[:120] + f".{g.shard_start}"


class OffloadFiles:
    """One group's offloaded tensors on NVMe: a file of ``numel`` elements of ``dtype`` per key
    (the optimizer's master and moments, or a parameter partition), with stable names (reused,
    not accumulated, across runs), read and written with plain ``pread``/``pwrite`` by the step
    and memory-mapped (shared) for whole-tensor access."""

    def __init__(self, directory: str, name: str, numel: int, keys: tuple[str, ...] = ("master",) + _STATE_KEYS,
                 dtype: torch.dtype = torch.float32) -> None:
        self.numel, self.elem = numel, torch.empty((), dtype=dtype).element_size()
        suffix = "fp32" if dtype == torch.float32 else str(dtype).replace("torch.", "")
        self.bytes_read = self.bytes_written = 0  # by the step's plain reads and writes
        self.fds, self.maps, self.tensors = {}, {}, {}
        for key in keys:
            path = os.path.join(directory, f"{name}.{key}.{suffix}")
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, numel * self.elem)
            self.fds[key] = fd
            self.maps[key] = mmap.mmap(fd, numel * self.elem)
            self.tensors[key] = torch.frombuffer(self.maps[key], dtype=dtype)

    def read(self, key: str, lo: int, out: torch.Tensor) -> None:
        file_io(os.preadv, self.fds[key], out, lo * self.elem)
        self.bytes_read += out.numel() * out.element_size()

    def write(self, key: str, lo: int, src: torch.Tensor) -> None:
        file_io(os.pwritev, self.fds[key], src, lo * self.elem)
        self.bytes_written += src.numel() * src.element_size()

    def drop_pages(self) -> None:
        for m in self.maps.values():
            m.madvise(mmap.MADV_DONTNEED)  # a shared file mapping keeps its data in the file / page cache


def file_io(op: Callable, fd: int, t: torch.Tensor, offset: int) -> None:
    """``op`` (``os.preadv`` / ``os.pwritev``) over all of ``t``'s bytes, retrying short transfers."""
    view = memoryview(t.view(torch.uint8).numpy())  # any dtype (bf16 has no numpy twin) as bytes
    done = 0
    while done < len(view):
        n = op(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"offload: {op.__name__} moved {n} bytes at offset {offset + done} of fd {fd} "
                          f"(the NVMe file is shorter than the partition, or the drive is full)")
        done += n


def bind_device(device: torch.device) -> None:
    """Make ``device`` the calling thread's CUDA device (CUDA's current device is per thread, 0 in a
    new one: an I/O thread of rank k would otherwise allocate and launch on GPU 0)."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def io_thread(name: str, device: torch.device) -> concurrent.futures.ThreadPoolExecutor:
    """One worker thread bound to ``device`` (:func:`bind_device`)."""
    return concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=name, initializer=bind_device,
                                                 initargs=(device,))


@contextlib.contextmanager
def _on(stream: Optional["torch.cuda.Stream"], after: Optional["torch.cuda.Event"]):
    """Run the body's copies on ``stream`` after ``after``, and wait for them before returning (the
    host reads the slot next, or refills it); without a stream (CPU, meta) just run the body."""
    if stream is None:
        yield
        return
    with torch.cuda.stream(stream):
        if after is not None:
            stream.wait_event(after)
        yield
    stream.synchronize()


def close_all(fd_maps: list[dict[str, int]], lock_fd: Optional[int]) -> None:
    """Close the files' descriptors, then the directory's lock."""
    for fds in fd_maps:
        for fd in fds.values():
            os.close(fd)
        fds.clear()
    if lock_fd is not None:
        os.close(lock_fd)


class OptimizerOffload:
    """The offloaded part of a ZeRO engine's optimizer: host or NVMe state for ``groups`` and the
    streamed step over it. The engine's torch optimizer still lists the offloaded masters (their
    state dict, step count and hyperparameters live there, so checkpoints and LR schedules see one
    optimizer); they carry no ``.grad`` at its step, which therefore skips them."""

    def __init__(self, groups: list[FlatGroup], config: OffloadOptimizerConfig, oc: OptimizerConfig,
                 device: torch.device, *, rank: int = 0, say: Callable[[str], None] = lambda m: None) -> None:
        self.config, self.oc, self.device = config, oc, torch.device(device)
        self.groups = list(groups)
        self.host = torch.device("meta") if self.device.type == "meta" else torch.device("cpu")
        self.nvme = config.device == "nvme" and self.device.type != "meta"
        numels = [g.shard_numel for g in self.groups]
        self.chunk = ring_chunk(sum(numels), max(numels or [1]), config.buffer_count, config.buffer_size,
                                config.device == "nvme")
        self.files: dict[FlatGroup, OffloadFiles] = {}
        self._lock_fd: Optional[int] = None
        self.events: Optional[list[tuple[str, int, float, float]]] = None  # set to a list to record stages
        # Called as (kind, chunk) at the end of each stage, on the stage's thread (tests of the overlap).
        self.stage_hook: Optional[Callable[[str, int], None]] = None
        # Where the updated compute-dtype weights go: the group's shard, unless the parameters are
        # offloaded too (the engine then points this at ParamOffload.write).
        self.write_shard: Callable[[FlatGroup, int, torch.Tensor], None] = \
            lambda g, lo, src: g.shard[lo:lo + src.numel()].copy_(src)
        if self.nvme:
            self.directory, self._lock_fd = claim_directory(config.nvme_path, rank)
        # All host state (masters and moments with ``cpu``) and the ring in one allocation, sized
        # exactly: pinning them one by one would round each up to a power of two.
        width = 1 + (3 if self.nvme else 0)  # gradient (+ master and moments read from NVMe)
        requests = {}
        if not self.nvme:
            for i, g in enumerate(self.groups):
                for key in ("master",) + _STATE_KEYS:
                    requests[key, i] = (g.shard_numel, torch.float32, "state")
        for s in range(config.buffer_count):
            for w in range(width):
                requests["ring", s, w] = (self.chunk, torch.float32, "ring")
        self.arena = HostArena(requests, config.pin_memory, self.device)
        self.pinned = self.arena.pinned
        self._moments: dict[FlatGroup, tuple[torch.Tensor, ...]] = {}
        for i, g in enumerate(self.groups):
            self._move_master(g, i)
        self.ring = [[self.arena.views["ring", s, w] for w in range(width)] for s in range(config.buffer_count)]
        if config.pin_memory and not self.pinned and self.device.type != "meta":
            say("offload_optimizer: pin_memory was asked for but host memory cannot be pinned here (no CUDA "
                "driver, or the container limits locked memory); the ring is pageable, so copies to and from "
                "the accelerator are synchronous")
        # Descriptors close when this object goes, released or not (a lock left open would refuse
        # the next engine on the same path).
        self._closer = weakref.finalize(self, close_all, [f.fds for f in self.files.values()], self._lock_fd)
        self._reader = io_thread("offload-read", self.device)
        self._writer = io_thread("offload-write", self.device)
        # On CUDA the threads copy on streams of their own (the legacy default stream would serialize
        # them with everything else), ordered after the step's producer by the event ``_ready``.
        cuda = self.device.type == "cuda"
        self._read_stream = torch.cuda.Stream(self.device) if cuda else None
        self._write_stream = torch.cuda.Stream(self.device) if cuda else None
        self._ready: Optional[torch.cuda.Event] = None

    # ------------------------------------------------------------------ placement

    def _move_master(self, g: FlatGroup, i: int) -> None:
        """Give ``g`` (the ``i``-th offloaded group) a host (or NVMe) fp32 master holding its
        current values; the accelerator's copy is freed (with fp32 compute the accelerator keeps
        ``g.shard``, the forward's weights)."""
        values = g.master
        if self.nvme:
            files = OffloadFiles(self.directory, file_name(g), g.shard_numel)
            self.files[g] = files
            for lo in range(0, g.shard_numel, self.chunk):  # written through the ring's size, not the map
                hi = min(lo + self.chunk, g.shard_numel)
                files.write("master", lo, values[lo:hi].detach().to("cpu", torch.float32).contiguous())
            g.master = files.tensors["master"]
        else:
            master = self.arena.views["master", i]
            master.copy_(values.detach())
            g.master = master
            self._moments[g] = tuple(self.arena.views[key, i] for key in _STATE_KEYS)

    # ------------------------------------------------------------------ the step

    def init_state(self, optimizer: torch.optim.Optimizer, g: FlatGroup) -> dict:
        """``optimizer``'s state for ``g``'s master, created (zero moments, step 0) if absent, as
        torch creates it at the first step: the moments' views of the host allocation (zeroed
        here), or the NVMe files' maps (whose old contents the first step does not read: it starts
        the moments from zero)."""
        state = optimizer.state[g.master]
        if "exp_avg" not in state:
            if self.nvme:
                for key in _STATE_KEYS:
                    state[key] = self.files[g].tensors[key]
            else:
                for key, t in zip(_STATE_KEYS, self._moments[g]):
                    state[key] = t.zero_()
            state["step"] = torch.zeros((), dtype=torch.float32, device=self.host)
        return state

    @torch.no_grad()
    def step(self, optimizer: torch.optim.Optimizer, grads: dict[FlatGroup, torch.Tensor], coef: float) -> None:
        """Adam on every offloaded group: ``grad = grads[g] * coef`` (the engine's unscale and clip),
        streamed through the ring; on return ``g.shard`` holds the updated compute-dtype weights."""
        hp = {p: pg for pg in optimizer.param_groups for p in pg["params"]}
        work = []
        for g in self.groups:
            first = "exp_avg" not in optimizer.state.get(g.master, {})
            state = self.init_state(optimizer, g)
            state["step"] += 1
            for lo in range(0, g.shard_numel, self.chunk):
                work.append((g, state, hp[g.master], lo, min(lo + self.chunk, g.shard_numel), first))
        self._grads = grads
        if self._read_stream is not None:  # the gradients and weights as the step's stream left them
            self._ready = torch.cuda.current_stream(self.device).record_event()
        try:
            self._stream(work, coef)
        finally:
            self._grads, self._ready = {}, None

    def _stream(self, work: list[tuple], coef: float) -> None:
        """The three-stage pipeline over ``work`` (one item per chunk) and the ring."""
        count = len(self.ring)
        fetched: dict[int, concurrent.futures.Future] = {}
        returned: dict[int, concurrent.futures.Future] = {}
        for i in range(min(count, len(work))):
            fetched[i] = self._reader.submit(self._fetch, i, work[i], self.ring[i % count])
        for i, item in enumerate(work):
            slot = self.ring[i % count]
            fetched.pop(i).result()
            self._step_chunk(i, item, slot, coef)
            returned[i] = self._writer.submit(self._return, i, item, slot)
            nxt = i + count  # the slot this chunk used is refilled once its return is done
            if nxt < len(work):
                fetched[nxt] = self._reader.submit(self._after, returned[i], self._fetch, nxt, work[nxt], slot)
        for f in returned.values():
            f.result()

    @staticmethod
    def _after(first: concurrent.futures.Future, fn: Callable, *args) -> None:
        first.result()
        fn(*args)

    def _record(self, kind: str, i: int, t0: float) -> None:
        if self.stage_hook is not None:
            self.stage_hook(kind, i)
        if self.events is not None:
            self.events.append((kind, i, t0, time.perf_counter()))

    def _fetch(self, i: int, item, slot: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        g, state, _, lo, hi, first = item
        n = hi - lo
        with _on(self._read_stream, self._ready):  # accelerator -> host (fp16/bf16 widened to fp32)
            slot[0][:n].copy_(self._grads[g][lo:hi], non_blocking=self.pinned)
        if self.nvme:
            files = self.files[g]
            files.read("master", lo, slot[1][:n])
            if first:  # the moments start at zero (the files may hold an earlier run's)
                slot[2][:n].zero_()
                slot[3][:n].zero_()
            else:
                files.read("exp_avg", lo, slot[2][:n])
                files.read("exp_avg_sq", lo, slot[3][:n])
        self._record("fetch", i, t0)

    def _views(self, item, slot):
        g, state, _, lo, hi, _ = item
        n = hi - lo
        if self.nvme:
            return slot[1][:n], slot[2][:n], slot[3][:n]
        return g.master[lo:hi], state["exp_avg"][lo:hi], state["exp_avg_sq"][lo:hi]

    def _step_chunk(self, i: int, item, slot: list[torch.Tensor], coef: float) -> None:
        t0 = time.perf_counter()
        g, state, group, lo, hi, _ = item
        grad = slot[0][:hi - lo]
        grad.mul_(coef)
        master, exp_avg, exp_avg_sq = self._views(item, slot)
        beta1, beta2 = group["betas"]
        kernel = torch._fused_adamw_ if self.oc.adam_w_mode else torch._fused_adam_
        if self.device.type == "meta":  # the rehearsal: shapes only
            kernel = lambda *a, **k: None  # noqa: E731
        kernel([master], [grad], [exp_avg], [exp_avg_sq], [], [state["step"]], lr=group["lr"], beta1=beta1,
               beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"], amsgrad=False, maximize=False,
               grad_scale=None, found_inf=None)
        if g.compute_dtype != torch.float32:
            # The gradient is spent: its slot carries the compute-dtype weights back.
            grad.view(g.compute_dtype)[:hi - lo].copy_(master)
        self._record("step", i, t0)

    def _return(self, i: int, item, slot: list[torch.Tensor]) -> None:
        t0 = time.perf_counter()
        g, _, _, lo, hi, _ = item
        n = hi - lo
        master, exp_avg, exp_avg_sq = self._views(item, slot)
        out = master if g.compute_dtype == torch.float32 else slot[0][:n].view(g.compute_dtype)[:n]
        with _on(self._write_stream, self._ready):  # host -> accelerator (or to the parameter offload's host copy)
            self.write_shard(g, lo, out)
        if self.nvme:
            files = self.files[g]
            files.write("master", lo, master)
            files.write("exp_avg", lo, exp_avg)
            files.write("exp_avg_sq", lo, exp_avg_sq)
        self._record("return", i, t0)

    # ------------------------------------------------------------------ accounting

    def host_bytes(self, optimizer: torch.optim.Optimizer) -> dict[str, int]:
        """Host bytes held: ``host_optimizer`` (masters and moments in memory, ``cpu``; the moments
        are held from construction, before the first step fills them) and ``host_ring`` (the
        step's buffers), which sum to the host allocation's size, alignment padding included; and
        ``nvme``, the files' size. ``optimizer`` is the engine's (its state adds no host bytes)."""
        if self.nvme:
            return {"host_optimizer": 0, "host_ring": self.arena.nbytes,
                    "nvme": sum(g.shard_numel for g in self.groups) * 12}
        return {"host_optimizer": self.arena.bytes_of("state"), "host_ring": self.arena.bytes_of("ring"), "nvme": 0}

    def io_bytes(self) -> tuple[int, int]:
        """Bytes read from and written to the NVMe files by the steps so far (0, 0 with ``cpu``)."""
        return (sum(f.bytes_read for f in self.files.values()), sum(f.bytes_written for f in self.files.values()))

    def drop_pages(self) -> None:
        """Unmap the NVMe pages a whole-tensor access (checkpoint, load) brought into this process."""
        for files in self.files.values():
            files.drop_pages()

    def release(self) -> None:
        """Stop the I/O threads and close the NVMe files, releasing the directory's lock (the maps
        close when the last tensor viewing them goes). The engine is unusable for steps after."""
        self._reader.shutdown(wait=True)
        self._writer.shutdown(wait=True)
        self._closer()
        self.files.clear()
        self._lock_fd = None
