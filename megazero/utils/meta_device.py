"""The meta device standing in for a GPU: a training step runs on it at full size, allocating nothing.

A meta tensor has a shape, a dtype, strides and a storage of the right size, and no memory;
every operator's meta kernel computes only what its output looks like. Three things keep a
real training step from running there as it would on a GPU, and :class:`MetaDeviceMode` /
:func:`cuda_attention_on_meta` supply them:

- *Reads of device values* (``.item()``, ``.tolist()``, ``.cpu()``, copying into a host
  tensor): a meta tensor has no value. They are answered with zeros (a gradient norm reads 0,
  an agreement flag "no") and reported to ``on_read``: on a GPU each one is a host
  synchronisation.
- *Speed*: most of torch's meta kernels are Python (type promotion and strides of every
  elementwise op, 0.1-1.5 ms each) and a step repeats the same few hundred calls per layer
  and micro-batch. Their output metadata is cached by operator and input metadata, as
  ``FakeTensorMode`` does (:class:`MetaKernelCache`).
- *Kernel choice*: ``scaled_dot_product_attention`` on meta decomposes into the math path
  (s x s scores); CUDA runs flash attention, whose meta kernel exists
  (:func:`cuda_attention_on_meta`).

Collectives (``c10d`` operators) are reported to ``on_collective`` as they are issued.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["MetaDeviceMode", "MetaKernelCache", "cuda_attention_on_meta"]

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


class MetaDeviceMode(TorchDispatchMode):
    """Answers reads of meta values with zeros (calling ``on_read()``), reports every ``c10d``
    operator to ``on_collective(func, args)`` before it runs, and runs meta kernels through a
    :class:`MetaKernelCache` (``cache=False``: every kernel runs; the results are the same).
    Enter it before (outside) a mode that must see every operator's outputs, such as
    ``LiveMemoryTracker``: cached outputs are made here, below it."""

    def __init__(self, *, cache: bool = True, on_read: Optional[Callable[[], None]] = None,
                 on_collective: Optional[Callable[[Any, tuple], None]] = None) -> None:
        super().__init__()
        self.cache = MetaKernelCache() if cache else None
        self.on_read, self.on_collective = on_read, on_collective

    def _read(self, value: Any) -> Any:
        if self.on_read is not None:
            self.on_read()
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
            if self.on_collective is not None:
                self.on_collective(func, args)
        elif self.cache is not None and self.cache.eligible(func):
            return self.cache.run(func, args, kwargs)
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_attention_on_meta() -> Iterator[None]:
    """While active, ``scaled_dot_product_attention`` on meta tensors runs the kernel CUDA picks:
    flash attention (its meta kernel and backward: output and log-sum-exp, no s x s scores) for
    unmasked fp16/bf16 inputs, the math path otherwise. Registered for meta's autograd key, so
    it holds in backward too (activation recomputation); removed on exit."""
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
