"""The meta device standing in for a GPU: a training step runs on it at full size, allocating nothing.

A meta tensor has a shape, a dtype, strides and a storage of the right size, and no memory;
every operator's meta kernel computes only what its output looks like. Three things keep a
real training step from running there as it would on a GPU, and :class:`MetaDeviceMode` /
:func:`cuda_kernels_on_meta` supply them:

- *Reads of device values* (``.item()``, ``.tolist()``, ``.cpu()``, copying into a host
  tensor), reported to ``on_read``: on a GPU each one is a host synchronisation. A meta
  tensor has no value; small ones whose contents came from the host (flags, counters, filled
  constants) keep them, and collectives treat every peer as holding the same (what a fake
  process group stands for): a DP agreement on what this rank used reads back this rank's
  flags. Everything computed on the device reads as zeros (a gradient norm of 0).
- *Speed*: most of torch's meta kernels are Python (type promotion and strides of every
  elementwise op, 0.1-1.5 ms each) and a step repeats the same few hundred calls per layer
  and micro-batch. Their output metadata is cached by operator and input metadata, as
  ``FakeTensorMode`` does (:class:`MetaKernelCache`).
- *Kernel choice*: ``scaled_dot_product_attention`` on meta decomposes into the math path
  (s x s scores); CUDA runs flash attention, whose meta kernel exists; ``dropout`` on meta keeps
  a mask of the input's dtype for backward, CUDA's fused kernel a bool one
  (:func:`cuda_kernels_on_meta`).

Collectives (``c10d`` operators) are reported to ``on_collective`` as they are issued.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MetaDeviceMode", "MetaKernelCache", "cuda_kernels_on_meta"]

_UNCACHEABLE = object()


class _NotCacheable(Exception):
    pass


class MetaKernelCache:
    """Output metadata of meta kernels by (operator, input metadata). Only operators that mutate
    nothing and return new tensors, with every tensor on meta, are cached; a hit makes its
    outputs anew with ``empty_strided``: the shapes, strides, dtypes and storage sizes the
    kernel gave (checked when the entry is made)."""

    def __init__(self) -> None:
        self.entries: dict[tuple, Any] = {}
        self._eligible: dict[Any, bool] = {}
        self.hits = self.misses = 0

    def eligible(self, func) -> bool:
        ok = self._eligible.get(func)
        if ok is None:
            schema = func._schema
            ok = func.namespace == "aten" and not schema.is_mutable and all(
                r.alias_info is None for r in schema.returns)
            self._eligible[func] = ok
        return ok

    @staticmethod
    def _key(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if not x.is_meta:
                raise _NotCacheable
            return (x.dtype, tuple(x.shape), x.stride(), x.storage_offset())
        if isinstance(x, (list, tuple)):
            return tuple(MetaKernelCache._key(v) for v in x)
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
            if _storage_sizes(_rebuild(entry)) != _storage_sizes(out):
                raise _NotCacheable
        except _NotCacheable:
            entry = _UNCACHEABLE
        self.entries[key] = entry
        return out


def _describe(out: Any) -> Any:
    if isinstance(out, torch.Tensor):
        if not out.is_meta or out.layout != torch.strided:
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


VALUE_LIMIT_BYTES = 1 << 16  # meta storages up to this size keep values that came from the host
_aten = torch.ops.aten
_FACTORIES = {_aten.zeros.default: 0, _aten.zeros_like.default: 0, _aten.new_zeros.default: 0,
              _aten.ones.default: 1, _aten.ones_like.default: 1, _aten.new_ones.default: 1}
_FULL = {_aten.full.default: 1, _aten.full_like.default: 1, _aten.new_full.default: 2, _aten.scalar_tensor.default: 0}
_SUM, _PRODUCT, _BXOR, _PREMUL_SUM = 0, 2, 7, 8  # c10d RedOpType values (AVG 1, MIN 3, MAX 4, BAND 5, BOR 6)


class _HostValues:
    """Values of small meta storages that came from the host: flags and counters the step moves to
    the device, reduces over its peers and reads back. Every peer of a fake process group is taken
    to hold what this rank holds (an all-reduce SUM of n ranks multiplies by n; MAX keeps the value).
    Anything computed on the device is unknown and reads as zeros."""

    def __init__(self) -> None:
        self.flat: dict[int, torch.Tensor] = {}  # storage key -> its elements, on the CPU

    def get(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        flat = self.flat.get(t.untyped_storage()._cdata)
        if flat is None or flat.dtype != t.dtype:
            return None
        return flat.as_strided(t.shape, t.stride(), t.storage_offset())

    def region(self, t: torch.Tensor) -> Optional[torch.Tensor]:
        """A writable CPU view of ``t``'s elements (a zero storage is made for a small one)."""
        storage = t.untyped_storage()
        key = storage._cdata
        flat = self.flat.get(key)
        if flat is None or flat.dtype != t.dtype:
            if storage.nbytes() > VALUE_LIMIT_BYTES:
                return None
            if key not in self.flat:
                weakref.finalize(storage, self.flat.pop, key, None)
            flat = self.flat[key] = torch.zeros(storage.nbytes() // t.dtype.itemsize, dtype=t.dtype)
        return flat.as_strided(t.shape, t.stride(), t.storage_offset())

    def forget(self, t: torch.Tensor) -> None:
        self.flat.pop(t.untyped_storage()._cdata, None)

    def write(self, dst: torch.Tensor, src: Any) -> None:
        """``dst`` (meta) now holds ``src``: a host tensor or number, a meta tensor, or None (unknown)."""
        region = self.region(dst)
        if region is None:
            return
        if isinstance(src, torch.Tensor) and src.is_meta:
            src = self.get(src)
        if src is None:
            region.zero_()
        elif isinstance(src, torch.Tensor):
            region.copy_(src)
        else:
            region.fill_(src)

    def after(self, func, args: tuple, kwargs: dict, out: Any, group_size: Callable[[Any], int]) -> None:
        """Keep the values current after ``func`` ran on meta tensors."""
        if func in _FACTORIES or func in _FULL:
            if isinstance(out, torch.Tensor) and out.is_meta:
                value = _FACTORIES[func] if func in _FACTORIES else (args[_FULL[func]] if len(args) > _FULL[func]
                                                                      else kwargs.get("fill_value"))
                self.write(out, value)
        elif func is _aten._to_copy.default and isinstance(out, torch.Tensor) and out.is_meta and not args[0].is_meta:
            self.write(out, args[0])
        elif func is _aten.copy_.default and args[0].is_meta:
            self.write(args[0], args[1])
        elif func in (_aten.fill_.Scalar, _aten.zero_.default) and args[0].is_meta:
            self.write(args[0], args[1] if len(args) > 1 else 0)
        elif func is torch.ops.c10d.allreduce_.default:
            op, n = args[2].op(), group_size(args[1])
            for t in args[0]:
                known = self.get(t) if t.is_meta else None
                if known is None:
                    continue
                if op == _SUM:
                    known.mul_(n)
                elif op == _PRODUCT:
                    known.pow_(n)
                elif op == _PREMUL_SUM or (op == _BXOR and n % 2 == 0):
                    self.write(t, None)
        elif func is not torch.ops.c10d.broadcast_.default and self.flat and func._schema.is_mutable:
            for t in _written(func, args, kwargs):  # anything else written on the device: unknown now
                self.forget(t)


def _written(func, args: tuple, kwargs: dict) -> Iterator[torch.Tensor]:
    for i, a in enumerate(func._schema.arguments):
        if a.alias_info is not None and a.alias_info.is_write:
            v = args[i] if i < len(args) else kwargs.get(a.name)
            for t in (v if isinstance(v, (list, tuple)) else (v,)):
                if isinstance(t, torch.Tensor) and t.is_meta:
                    yield t


class MetaDeviceMode(TorchDispatchMode):
    """Answers reads of meta values (calling ``on_read()``): with the values of small storages that
    came from the host (:class:`_HostValues`), zeros otherwise; reports every ``c10d`` operator to
    ``on_collective(func, args)`` before it runs; and runs meta kernels through a
    :class:`MetaKernelCache` (``cache=False``: every kernel runs; the results are the same).
    Enter it before (outside) a mode that must see every operator's outputs, such as
    ``LiveMemoryTracker``: cached outputs are made here, below it."""

    def __init__(self, *, cache: bool = True, on_read: Optional[Callable[[], None]] = None,
                 on_collective: Optional[Callable[[Any, tuple], None]] = None) -> None:
        super().__init__()
        self.cache = MetaKernelCache() if cache else None
        self.on_read, self.on_collective = on_read, on_collective
        self.values = _HostValues()

    def _read(self, value: Any) -> Any:
        if self.on_read is not None:
            self.on_read()
        return value

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _aten._local_scalar_dense.default and args[0].is_meta:  # .item(), float(), bool()
            known = self.values.get(args[0])
            if known is not None:
                return self._read(known.item())
            dtype = args[0].dtype
            return self._read(False if dtype == torch.bool else 0.0 if dtype.is_floating_point else 0)
        if func is _aten._to_copy.default and args[0].is_meta:  # .cpu(), .tolist()
            device = kwargs.get("device")
            if device is not None and torch.device(device).type != "meta":
                known = self.values.get(args[0])
                dtype = kwargs.get("dtype") or args[0].dtype
                return self._read(known.to(device=device, dtype=dtype, copy=True) if known is not None
                                  else torch.zeros(args[0].shape, dtype=dtype, device=device))
        if func is _aten.copy_.default and args[1].is_meta and not args[0].is_meta:
            known = self.values.get(args[1])
            return self._read(args[0].copy_(known) if known is not None else args[0].zero_())
        if func.namespace == "c10d":
            if self.on_collective is not None:
                self.on_collective(func, args)
            out = func(*args, **kwargs)
        elif self.cache is not None and self.cache.eligible(func):
            out = self.cache.run(func, args, kwargs)
        else:
            out = func(*args, **kwargs)
        self.values.after(func, args, kwargs, out, lambda pg: torch.distributed.ProcessGroup.unbox(pg).size())
        return out


@contextlib.contextmanager
def cuda_kernels_on_meta() -> Iterator[None]:
    """While active, ``scaled_dot_product_attention`` and ``dropout`` on meta tensors run the kernels CUDA
    picks: flash attention (its meta kernel and backward: output and log-sum-exp, no s x s scores) for
    unmasked fp16/bf16 inputs (memory-efficient attention, the same, where values are narrower or
    wider than queries and keys), the math path otherwise; and the fused dropout, whose mask is bool (one
    byte per element, where meta's decomposition keeps a mask of the input's dtype). Registered for
    meta's autograd key, so it holds in backward too (activation recomputation); removed on exit."""
    lib = torch.library.Library("aten", "IMPL")

    def sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None, enable_gqa=False):
        fused = attn_mask is None and q.dtype in (torch.float16, torch.bfloat16) and not enable_gqa
        if fused and v.size(-1) != q.size(-1):  # flash needs one head width: CUDA picks memory-efficient
            return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, dropout_p, is_causal,
                                                                          scale=scale)[0]
        if fused:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                      scale=scale)[0]
        return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, attn_mask, dropout_p, is_causal,
                                                                 scale=scale, enable_gqa=enable_gqa)[0]

    def dropout(x, p, train):
        return torch.ops.aten.native_dropout(x, p, train)[0] if train and p > 0 else x

    lib.impl("scaled_dot_product_attention", sdpa, "AutogradMeta")
    lib.impl("dropout", dropout, "AutogradMeta")
    try:
        yield
    finally:
        lib._destroy()
