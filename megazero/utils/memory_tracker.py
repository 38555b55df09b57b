"""Live tensor memory of a region of code: current and peak bytes, on CPU, meta and CUDA.

What ZeRO promises is a bound on the memory alive *during* a step, so that is what
this measures: the bytes of every live tensor storage, including those that only
autograd still holds (saved tensors) and those shrunk or regrown in place with
``untyped_storage().resize_()`` (how a sharded engine frees a gathered buffer that
autograd still references, and reuses it).

CUDA: the caching allocator already counts this; the tracker reads
``memory_allocated`` / ``max_memory_allocated`` (after ``reset_peak_memory_stats`` at
entry). No overhead; every tensor on the device counts.

CPU and meta: no allocator statistics, so the tracker accounts storages itself (a meta
storage has no memory but knows its size: a rehearsal of a large run on the meta device,
``megazero.observe.rehearsal``, measures what the run would hold):

- a ``TorchDispatchMode`` sees every ATen operator run on this thread (forward,
  backward, collectives) and registers the storages of its outputs: a return the
  schema marks as aliasing an input is a view (no new bytes), any other is a new
  allocation;
- a weak reference per storage (storages keep one Python object for their whole
  life) reports the moment the last tensor, view or autograd saved tensor using it
  is gone;
- ``UntypedStorage.resize_`` is wrapped while a CPU (or meta) tracker is active, and only
  then (the last tracker to exit puts back what was there, also when the region raised), so
  in-place shrinking and regrowing is seen when it happens;
- at entry, the tensors Python can reach (``gc``: parameters, gradients, optimizer
  states, ...) form the baseline.

Kinds (CPU and meta, optional): with ``kind_of``, every storage carries a label (given when
it is allocated or resized, reset by ``reset_peak(relabel=...)``), and ``peak_by_kind`` splits
the peak by label: what existed before a step versus what the step made, say.

Exactness (CPU, meta): figures change at operator boundaries. Not counted: temporaries an
operator allocates inside its kernel (also when they outlive it, as gloo's
reduce-scatter buffer does until ``wait()``), storages created without an ATen
operator (``torch.from_numpy``, unpickling), and storages that only C++ held at entry
(an earlier graph's saved tensors): neither their bytes nor their release, so the
figures never drift below the truth. Work done on other threads than the one that entered is not
seen (CPU autograd runs backward on the calling thread, so it is), but frees are, from
any thread: a collective's buffers die when the backend's thread lets go of them, a
moment after ``wait()`` (see ``settle()``).

Usage::

    with LiveMemoryTracker("cpu") as t:
        loss = model(x).sum(); t.mark("after_forward")
        loss.backward()
    t.peak_bytes, t.marks["after_forward"].current_bytes
"""

from __future__ import annotations

import functools
import gc
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Optional, Union

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["LiveMemoryTracker", "MemoryMark", "active_tracker", "peak_memory_source", "step_peak_memory"]

DeviceLike = Union[str, torch.device, int, None]
# Device types whose storages the tracker accounts itself (CUDA is read from its allocator).
ACCOUNTED_DEVICE_TYPES = ("cpu", "meta")
# The label of storages found at entry (``scan_existing``) when kinds are tracked.
BASELINE_KIND = "baseline"


class _ResizeHook:
    """Wraps ``torch.UntypedStorage.resize_`` while at least one accounting is registered, and puts
    back exactly what was there when the last one leaves.

    ``UntypedStorage.resize_`` on CPU (and meta) reallocates outside the dispatcher, so the mode
    cannot see it; ZeRO-3 and FSDP free and regrow gathered buffers exactly this way.
    """

    _ABSENT = object()  # resize_ was inherited, not set on UntypedStorage itself

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._accs: list[_StorageAccounting] = []
        self._saved: Any = None  # while wrapped: UntypedStorage's own resize_ before, or _ABSENT

    def add(self, acc: "_StorageAccounting") -> None:
        with self._lock:
            if not self._accs:
                self._saved = torch.UntypedStorage.__dict__.get("resize_", self._ABSENT)
                torch.UntypedStorage.resize_ = self._wrap(torch.UntypedStorage.resize_)
            self._accs.append(acc)

    def remove(self, acc: "_StorageAccounting") -> None:
        with self._lock:
            if acc in self._accs:
                self._accs.remove(acc)
            if not self._accs and self._saved is not None:
                if self._saved is self._ABSENT:
                    del torch.UntypedStorage.resize_  # back to the inherited C implementation
                else:
                    torch.UntypedStorage.resize_ = self._saved
                self._saved = None

    @property
    def wrapped(self) -> bool:
        return self._saved is not None

    def _wrap(self, resize: Callable) -> Callable:
        hook = self

        def resize_(storage: torch.UntypedStorage, size: int):
            old = storage.nbytes()
            out = resize(storage, size)
            if storage.device.type in ACCOUNTED_DEVICE_TYPES:
                hook._notify(storage, old)
            return out

        return resize_

    def _notify(self, storage: torch.UntypedStorage, old_nbytes: int) -> None:
        with self._lock:
            accs = [a for a in self._accs if a.device_type == storage.device.type]
        for acc in accs:
            acc.note_resize(storage, old_nbytes)


@dataclass(frozen=True)
class MemoryMark:
    """Live bytes at a named point: above the baseline, absolute, and the peak so far (above the baseline)."""

    name: str
    current_bytes: int
    absolute_bytes: int
    peak_bytes: int


class LiveMemoryTracker:
    """Context manager measuring live tensor bytes on ``device`` (``'cpu'``, ``'meta'`` or a CUDA device).

    Figures (all in bytes; the ``*_bytes`` without ``absolute`` are relative to entry):

    - ``baseline_bytes``: live at entry (on CPU: the storages Python could reach then,
      plus any older storage resized in place since);
    - ``current_bytes`` / ``absolute_current_bytes``: live now (frozen at exit);
      ``current_bytes`` is negative if more pre-existing memory was freed than allocated;
    - ``peak_bytes`` / ``absolute_peak_bytes``: the maximum since entry or ``reset_peak()``;
    - ``marks``: ``name -> MemoryMark`` recorded by ``mark(name)``.

    ``scan_existing=False`` (CPU) skips the ``gc`` walk at entry (tens of ms on a large
    Python heap): only what the region allocates is counted (and older storages it resizes).
    CPU (and meta) trackers nest and count independently. CUDA trackers share the device's peak
    statistics: entering one, ``reset_peak()`` or ``step_peak_memory()`` restarts them for all.

    ``kind_of(event)`` (CPU and meta): the label of a storage allocated (``event='alloc'``) or
    resized in place (``'resize'``) now; then ``live_by_kind`` / ``peak_by_kind`` split the
    absolute figures by label (storages found at entry are ``'baseline'``). ``where()`` (CPU
    and meta): called whenever the peak rises; ``peak_where`` is what it said last (e.g. the
    source line running then).
    """

    # Owned by the class, shared by its instances: the trackers entered and not yet exited,
    # innermost last (how the trainer's log line finds the tracker measuring it without being
    # handed one), and the one wrap of UntypedStorage.resize_ that CPU and meta trackers share.
    _entered: ClassVar[list["LiveMemoryTracker"]] = []
    _resize_hook: ClassVar[_ResizeHook] = _ResizeHook()

    def __init__(self, device: DeviceLike = "cpu", *, scan_existing: bool = True,
                 kind_of: Optional[Callable[[str], str]] = None, where: Optional[Callable[[], Any]] = None) -> None:
        self.device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cpu")
        if self.device.type not in ACCOUNTED_DEVICE_TYPES + ("cuda",):
            raise ValueError(f"LiveMemoryTracker measures 'cpu', 'meta' or 'cuda' devices, got {self.device}")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"LiveMemoryTracker({self.device}): CUDA is not available in this process")
        if (kind_of is not None or where is not None) and self.device.type == "cuda":
            raise ValueError("LiveMemoryTracker(kind_of=, where=) need storage accounting: 'cpu' or 'meta'")
        self.scan_existing = scan_existing
        self.kind_of, self.where = kind_of, where
        self.marks: dict[str, MemoryMark] = {}
        self._acc: Optional[_StorageAccounting] = None
        self._mode: Optional[_AccountingMode] = None
        self._active = False
        self._frozen: Optional[tuple[int, int, int]] = None  # (baseline, live, peak) at exit
        self._frozen_kinds: Optional[tuple[dict[str, int], dict[str, int]]] = None  # (live, peak) by kind at exit
        self._frozen_where: Any = None
        self._cuda_baseline = 0

    # ---- context ---------------------------------------------------------------------------

    def __enter__(self) -> "LiveMemoryTracker":
        if self._active:
            raise RuntimeError("LiveMemoryTracker is not reentrant; create one tracker per region")
        self.marks.clear()
        self._frozen = self._frozen_kinds = None
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._cuda_baseline = torch.cuda.memory_allocated(self.device)
        else:
            self._acc = _StorageAccounting(self.device.type, self.kind_of, self.where)
            if self.scan_existing:
                self._acc.scan_reachable()
            self._mode = _AccountingMode(self._acc)
            self._mode.__enter__()
            try:
                self._resize_hook.add(self._acc)
            except BaseException:
                self._mode.__exit__(None, None, None)
                self._acc.close()
                self._acc = self._mode = None
                raise
        self._active = True
        self._entered.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self._frozen = self._read()
            if self._acc is not None:
                self._frozen_kinds, self._frozen_where = self._acc.kinds(), self._acc.peak_where
        finally:  # whatever happened, nothing of this tracker stays installed
            self._active = False
            if self in self._entered:
                self._entered.remove(self)
            if self._acc is not None:
                try:
                    self._resize_hook.remove(self._acc)
                    self._mode.__exit__(*exc)
                finally:
                    self._acc.close()
                    self._acc = self._mode = None

    # ---- figures ---------------------------------------------------------------------------

    def _read(self) -> tuple[int, int, int]:
        if self._frozen is not None and not self._active:
            return self._frozen
        if not self._active:
            raise RuntimeError("LiveMemoryTracker: enter the context (with ...) before reading figures")
        if self.device.type == "cuda":
            return (self._cuda_baseline, torch.cuda.memory_allocated(self.device),
                    torch.cuda.max_memory_allocated(self.device))
        return self._acc.snapshot()

    @property
    def baseline_bytes(self) -> int:
        return self._read()[0]

    @property
    def absolute_current_bytes(self) -> int:
        return self._read()[1]

    @property
    def absolute_peak_bytes(self) -> int:
        return self._read()[2]

    @property
    def current_bytes(self) -> int:
        baseline, live, _ = self._read()
        return live - baseline

    @property
    def peak_bytes(self) -> int:
        baseline, _, peak = self._read()
        return peak - baseline

    def mark(self, name: str, *, settle: bool = False) -> MemoryMark:
        """Record (and return) the live bytes now under ``name`` (a later mark of the same name
        replaces it); ``settle=True`` first waits for communication buffers to be released."""
        if settle:
            self.settle()
        baseline, live, peak = self._read()
        m = MemoryMark(name, live - baseline, live, peak - baseline)
        self.marks[name] = m
        return m

    def settle(self, quiet_s: float = 0.02, timeout_s: float = 2.0) -> int:
        """Wait until the live bytes have not changed for ``quiet_s`` (at most ``timeout_s``);
        return ``current_bytes``.

        A finished collective's tensors are released a moment *after* ``wait()`` returns:
        gloo's worker thread (and NCCL's watchdog) drop their reference to the work, and with
        it to its input and output tensors, on their own schedule. Call this before an exact
        reading that follows communication.
        """
        deadline = time.monotonic() + timeout_s
        last, since = self.current_bytes, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(quiet_s / 4)
            now = self.current_bytes
            if now != last:
                last, since = now, time.monotonic()
            elif time.monotonic() - since >= quiet_s:
                break
        return last

    def reset_peak(self, *, relabel: Optional[str] = None) -> None:
        """Start a new peak window at the current live bytes (e.g. per step or log interval);
        ``relabel`` (with ``kind_of``) gives every live storage that label first."""
        if not self._active:
            raise RuntimeError("LiveMemoryTracker.reset_peak() needs an active tracker")
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._acc.reset_peak(relabel)

    @property
    def live_by_kind(self) -> dict[str, int]:
        """Live bytes now (absolute) by ``kind_of`` label; empty without ``kind_of``."""
        if self._acc is None:
            return dict(self._frozen_kinds[0]) if self._frozen_kinds else {}
        return self._acc.kinds()[0]

    @property
    def peak_where(self) -> Any:
        """What ``where()`` returned when the peak was last raised (None before, or without ``where``)."""
        return self._acc.peak_where if self._acc is not None else self._frozen_where

    @property
    def peak_by_kind(self) -> dict[str, int]:
        """The absolute peak by ``kind_of`` label, as it stood when the peak was reached."""
        if self._acc is None:
            return dict(self._frozen_kinds[1]) if self._frozen_kinds else {}
        return self._acc.kinds()[1]

    def __repr__(self) -> str:
        state = "active" if self._active else ("done" if self._frozen else "not started")
        if state == "not started":
            return f"LiveMemoryTracker({self.device}, {state})"
        return (f"LiveMemoryTracker({self.device}, {state}: baseline={self.baseline_bytes} B, "
                f"current={self.current_bytes:+d} B, peak=+{self.peak_bytes} B)")


def active_tracker(device: DeviceLike = None) -> Optional[LiveMemoryTracker]:
    """The innermost active tracker (on ``device``'s type if given), or None."""
    kind = None if device is None else (torch.device("cuda", device) if isinstance(device, int)
                                        else torch.device(device)).type
    for t in reversed(LiveMemoryTracker._entered):
        if kind is None or t.device.type == kind:
            return t
    return None


def peak_memory_source(device: DeviceLike = None) -> str:
    """What ``step_peak_memory(device)`` would report now: ``'cuda_peak_allocated'``,
    ``'tracked_peak_live'`` or ``'rss'`` (for a log line's label)."""
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cpu")
    if dev.type == "cuda" and torch.cuda.is_available():
        return "cuda_peak_allocated"
    return "tracked_peak_live" if active_tracker(_accounted_type(dev)) is not None else "rss"


def _accounted_type(dev: torch.device) -> str:
    """The device type whose tracker measures ``dev``: meta for meta, else the CPU."""
    return dev.type if dev.type in ACCOUNTED_DEVICE_TYPES else "cpu"


def step_peak_memory(device: DeviceLike = None, *, reset: bool = True) -> tuple[int, str]:
    """``(bytes, source)``: the peak memory since the previous call, for a per-interval log line.

    - CUDA device: ``max_memory_allocated`` (source ``'cuda_peak_allocated'``), and the
      peak statistics are reset so the next call covers the next interval;
    - otherwise, inside an active CPU (for a meta ``device``: meta) ``LiveMemoryTracker``: its
      absolute peak of live tensor bytes (``'tracked_peak_live'``), and its peak window restarts;
    - otherwise: the process's resident set size (``'rss'``, current not peak: CPU
      allocators keep no peak), from ``/proc/self/status`` or ``getrusage`` (peak RSS).
    """
    source = peak_memory_source(device)
    if source == "cuda_peak_allocated":
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        peak = torch.cuda.max_memory_allocated(dev)
        if reset:
            torch.cuda.reset_peak_memory_stats(dev)
        return peak, source
    if source == "tracked_peak_live":
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cpu")
        tracker = active_tracker(_accounted_type(dev))
        peak = tracker.absolute_peak_bytes
        if reset:
            tracker.reset_peak()
        return peak, source
    return _rss_bytes(), source


def _rss_bytes() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


# ---- CPU (and meta) accounting ---------------------------------------------------------------


class _StorageAccounting:
    """Bytes of the storages of one device type known to us, kept current by weak-reference callbacks.

    Known storages: those reachable from Python at entry (the baseline), those an
    operator returned as a new allocation since, and any resized in place. A storage
    first met later as an operator's input or view is ignored, alive or freed: it may
    predate the region (held by C++ only, e.g. an earlier graph's saved tensors) or have
    been made inside a kernel or a backend's thread (gloo's reduce-scatter buffer), and
    counting its free without its allocation would drift below the truth.

    Keyed by the storage's C++ address (``_cdata``): a storage's callback runs when it
    dies, before that address can be reused. With ``kind_of``, each entry also carries a
    label and the live bytes are kept per label, with a copy taken at every new peak.
    """

    def __init__(self, device_type: str = "cpu", kind_of: Optional[Callable[[str], str]] = None,
                 where: Optional[Callable[[], Any]] = None) -> None:
        self.device_type, self.kind_of, self.where = device_type, kind_of, where
        self.peak_where: Any = None
        # RLock: a weak-reference callback can run on this thread while the lock is held.
        self._lock = threading.RLock()
        self._storages: dict[int, list] = {}  # key -> [weakref, nbytes, kind]
        self._baseline = self._live = self._peak = 0
        self._by_kind: dict[str, int] = {}
        self._peak_by_kind: dict[str, int] = {}

    def storage_of(self, t: torch.Tensor) -> Optional[torch.UntypedStorage]:
        if not (t.is_meta if self.device_type == "meta" else t.is_cpu):  # cheaper than t.device.type
            return None
        try:
            return t.untyped_storage()
        except (RuntimeError, NotImplementedError):  # sparse tensors, wrapper subclasses: no storage
            return None

    def scan_reachable(self) -> None:
        # Unreachable cycles are collected first: left to the collector, their storages would be
        # freed inside the measured region and count against it (a negative rise).
        gc.collect()
        for obj in gc.get_objects():
            # issubclass(type(...)): isinstance would consult __class__ of proxies (and their warnings).
            if issubclass(type(obj), torch.Tensor):
                self._scan(obj)
                if obj.is_leaf:  # autograd-made gradients may have no Python object yet: this makes one
                    grad = obj._grad
                    if grad is not None:
                        self._scan(grad)

    def _scan(self, t: torch.Tensor) -> None:
        storage = self.storage_of(t)
        if storage is not None and storage._cdata not in self._storages:
            self.add(storage, storage.nbytes(), pre_existing=True)

    def _count_kind(self, kind: Optional[str], n: int) -> None:
        if kind is not None:
            self._by_kind[kind] = self._by_kind.get(kind, 0) + n

    def _new_peak(self) -> None:
        if self._live > self._peak:
            self._peak = self._live
            if self.kind_of is not None:
                self._peak_by_kind = dict(self._by_kind)
            if self.where is not None:
                self.peak_where = self.where()

    def add(self, storage: torch.UntypedStorage, nbytes: int, pre_existing: bool) -> None:
        key = storage._cdata
        ref = weakref.ref(storage, functools.partial(_on_storage_freed, weakref.ref(self), key))
        kind = None if self.kind_of is None else (BASELINE_KIND if pre_existing else self.kind_of("alloc"))
        with self._lock:
            self._storages[key] = [ref, nbytes, kind]
            self._live += nbytes
            self._count_kind(kind, nbytes)
            if pre_existing:  # alive since before entry, hence at every moment since: part of every figure
                self._baseline += nbytes
                self._peak += nbytes
                if kind is not None:
                    self._peak_by_kind[kind] = self._peak_by_kind.get(kind, 0) + nbytes
            else:
                self._new_peak()

    def observe(self, storage: torch.UntypedStorage, fresh: bool, input_keys) -> None:
        """An operator returned a tensor on ``storage``; ``fresh``: its schema says a new one."""
        key = storage._cdata
        entry = self._storages.get(key)
        if entry is not None:
            n = storage.nbytes()
            if entry[1] != n:  # resized by the operator (aten::resize_, set_)
                self._resized(entry, n)
        elif fresh and key not in input_keys():  # aten::_unsafe_view shares its input's storage unannounced
            self.add(storage, storage.nbytes(), pre_existing=False)

    def note_resize(self, storage: torch.UntypedStorage, old_nbytes: int) -> None:
        with self._lock:
            entry = self._storages.get(storage._cdata)
            if entry is None:  # it had old_nbytes before this call: a storage that predates us
                self.add(storage, old_nbytes, pre_existing=True)
                entry = self._storages[storage._cdata]
            if entry[1] != storage.nbytes():
                self._resized(entry, storage.nbytes())

    def _resized(self, entry: list, n: int) -> None:
        with self._lock:
            self._live += n - entry[1]
            if self.kind_of is not None:  # the storage now counts under the label of its resize
                self._count_kind(entry[2], -entry[1])
                entry[2] = self.kind_of("resize")
                self._count_kind(entry[2], n)
            entry[1] = n
            self._new_peak()

    def freed(self, key: int) -> None:
        with self._lock:
            entry = self._storages.pop(key, None)
            if entry is not None:
                self._live -= entry[1]
                self._count_kind(entry[2], -entry[1])

    def snapshot(self) -> tuple[int, int, int]:
        with self._lock:
            return self._baseline, self._live, self._peak

    def kinds(self) -> tuple[dict[str, int], dict[str, int]]:
        """``(live, peak)`` bytes by label (labels whose bytes are zero left out)."""
        with self._lock:
            return ({k: v for k, v in self._by_kind.items() if v}, {k: v for k, v in self._peak_by_kind.items() if v})

    def reset_peak(self, relabel: Optional[str] = None) -> None:
        with self._lock:
            if relabel is not None and self.kind_of is not None:
                for entry in self._storages.values():
                    entry[2] = relabel
                self._by_kind = {relabel: self._live}
            self._peak = self._live
            self._peak_by_kind = dict(self._by_kind)
            self.peak_where = None

    def close(self) -> None:
        with self._lock:
            self._storages.clear()  # drops the weak references, and with them the callbacks


def _on_storage_freed(acc_ref: "weakref.ref[_StorageAccounting]", key: int, _storage_ref: Any) -> None:
    acc = acc_ref()
    if acc is not None:
        acc.freed(key)


_LIFT_FRESH = torch.ops.aten.lift_fresh.default


@functools.lru_cache(maxsize=None)
def _fresh_returns(func: Any) -> tuple[bool, ...]:
    """Per return of ``func``: True if it is a new allocation (the schema does not alias it to an input)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return (True,)
    return tuple(r.alias_info is None for r in schema.returns) or (True,)


@functools.lru_cache(maxsize=None)
def _views_only(func: Any) -> bool:
    """``func`` writes nothing and returns only views of its inputs (view, t, slice, ...): its
    outputs bring no new bytes and cannot resize a storage, so there is nothing to observe."""
    schema = getattr(func, "_schema", None)
    return schema is not None and bool(schema.returns) and not schema.is_mutable and \
        all(r.alias_info is not None for r in schema.returns)


class _AccountingMode(TorchDispatchMode):
    def __init__(self, acc: _StorageAccounting) -> None:
        super().__init__()
        self.acc = acc

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        observe = self.acc.observe
        storage_of = self.acc.storage_of
        if func is _LIFT_FRESH:  # torch.tensor(data) built its tensor outside the dispatcher just now
            storage = storage_of(out)
            if storage is not None:
                observe(storage, True, tuple)
            return out
        if _views_only(func):
            return out
        keys: Optional[set] = None

        def input_keys() -> set:  # only needed for a storage we do not know yet: computed lazily
            nonlocal keys
            if keys is None:
                keys = {st._cdata for st in map(storage_of, _tensors((args, kwargs.values() if kwargs else ())))
                        if st is not None}
            return keys

        fresh = _fresh_returns(func)
        if len(fresh) > 1 and isinstance(out, (tuple, list)) and len(out) == len(fresh):
            pairs = ((flag, t) for flag, o in zip(fresh, out) for t in _tensors((o,)))
        else:
            pairs = ((fresh[0], t) for t in _tensors((out,)))
        for flag, t in pairs:
            storage = storage_of(t)
            if storage is not None:
                observe(storage, flag, input_keys)
        return out


def _tensors(values):
    """The tensors among ``values`` and in their (nested) lists and tuples: operator
    arguments and returns hold nothing else (pytree would be general, and slower)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)
