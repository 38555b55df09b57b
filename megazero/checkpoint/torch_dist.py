"""Read torch.distributed.checkpoint (DCP) directories, as Megatron-LM's ``torch_dist`` format writes them,
without megatron and without running code from the checkpoint.

An iteration directory holds ``.metadata`` (a pickle of DCP's ``Metadata``: every key's global shape, dtype and
chunks, and where each chunk's bytes are), ``__R_I.distcp`` files (each chunk a ``torch.save`` blob at an
offset), ``common.pt`` (Megatron's non-sharded state: ``args``, ``iteration``, ...) and ``metadata.json``.

``.metadata`` is unpickled with an allow-list of exactly DCP's metadata classes, ``torch.Size``, the dtypes,
the layout / memory-format helpers and ``pathlib`` paths (the saved checkpoint id); ``common.pt`` with
``megatron_pickle.load_megatron_file``. ``read(key, index)``
reads only the chunks the region overlaps, and of each chunk only the rows it needs (the blob's zip
directory, its small pickle and those rows' bytes), falling back to loading the chunk's blob whole
(``torch.load(weights_only=True)``) when the blob is not a plain little-endian stored tensor.
"""

from __future__ import annotations

import io
import json
import math
import os
import pickle
import struct
import zipfile
from typing import Any, Optional, Union

import torch

from megazero.zero.shard_io import CheckpointError

__all__ = ["is_torch_dist", "TorchDistCheckpoint", "resolve_iteration_dir"]

_TRACKER = "latest_checkpointed_iteration.txt"
_DCP = "torch.distributed.checkpoint."
_ALLOWED = {
    _DCP + "metadata": {"Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING"},
    _DCP + "filesystem": {"_StorageInfo"},
    _DCP + "planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "collections": {"OrderedDict"},
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},  # StorageMeta.checkpoint_id
}
Index = Union[int, slice, tuple]


def resolve_iteration_dir(path: str) -> tuple[str, Optional[int]]:
    """``(iteration directory, iteration or None)`` of a ``--save`` directory (its tracker file names the
    iteration) or of one iteration directory."""
    tracker = os.path.join(path, _TRACKER)
    if os.path.isfile(tracker):
        it = open(tracker).read().strip()
        sub = "release" if it == "release" else f"iter_{int(it):07d}" if it.isdigit() else it
        return os.path.join(path, sub), (int(it) if it.isdigit() else None)
    base = os.path.basename(os.path.normpath(path))
    return path, (int(base[5:]) if base.startswith("iter_") and base[5:].isdigit() else None)


def is_torch_dist(path: str) -> bool:
    """Whether ``path`` (a ``--save`` directory or one iteration directory) is a DCP / torch_dist checkpoint."""
    if not path or not os.path.isdir(path):
        return False
    directory, _ = resolve_iteration_dir(path)
    meta = os.path.join(directory, "metadata.json")
    if os.path.isfile(meta):
        try:
            return json.load(open(meta)).get("sharded_backend") in ("torch_dist", "torch_dcp")
        except (OSError, ValueError, AttributeError):
            return False
    return os.path.isfile(os.path.join(directory, ".metadata"))


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list (not a damaged file)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's ``.metadata`` and nothing else: a class outside ``_ALLOWED`` is refused by name."""

    def find_class(self, module: str, name: str) -> Any:
        if name in _ALLOWED.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Refused(f"{module}.{name}")


def _load_metadata(path: str) -> Any:
    if not os.path.isfile(path):
        raise CheckpointError(f"{path} does not exist: {os.path.dirname(path)} is not a complete torch_dist "
                              f"checkpoint (the save was interrupted, or this is not the iteration directory)")
    try:
        with open(path, "rb") as f:
            meta = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise CheckpointError(f"{path} holds a Python object outside the allow-list of DCP metadata classes "
                              f"({e}); refusing to unpickle it (is this file from a trusted torch_dist save?)") from None
    except Exception as e:  # truncated or garbled pickles raise many types
        raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e} (truncated or corrupt; re-copy "
                              f"the checkpoint)") from None
    if not hasattr(meta, "state_dict_metadata") or not hasattr(meta, "storage_data"):
        raise CheckpointError(f"{path} is not torch.distributed.checkpoint metadata (got {type(meta).__name__})")
    return meta


def _normalize(index: Index, shape: tuple[int, ...], key: str) -> tuple[list[tuple[int, int]], list[bool]]:
    """Per dimension ``[start, stop)`` of ``index`` over ``shape``, and which dimensions an int removes."""
    idx = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in idx):
        at = idx.index(Ellipsis)
        idx = idx[:at] + (slice(None),) * (len(shape) - len(idx) + 1) + idx[at + 1:]
    if len(idx) > len(shape):
        raise IndexError(f"{key}: index {index} has more dimensions than its shape {tuple(shape)}")
    bounds, drop = [], []
    for d, n in enumerate(shape):
        i = idx[d] if d < len(idx) else slice(None)
        if isinstance(i, slice):
            start, stop, step = i.indices(n)
            if step != 1:
                raise IndexError(f"{key}: index {index} has a step; read a contiguous region")
            bounds.append((start, max(start, stop)))
            drop.append(False)
        else:
            j = int(i) + (n if int(i) < 0 else 0)
            if not 0 <= j < n:
                raise IndexError(f"{key}: index {i} is out of range for dimension {d} of size {n}")
            bounds.append((j, j + 1))
            drop.append(True)
    return bounds, drop


class _Window(io.RawIOBase):
    """A read-only file view of bytes ``[start, start + length)`` of ``f`` that counts what it reads."""

    def __init__(self, f, start: int, length: int, counter: list) -> None:
        self.f, self.start, self.length, self.pos, self.counter = f, start, length, 0, counter

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, pos: int, whence: int = 0) -> int:
        self.pos = pos if whence == 0 else self.pos + pos if whence == 1 else self.length + pos
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        n = self.length - self.pos if n is None or n < 0 else min(n, self.length - self.pos)
        self.f.seek(self.start + self.pos)
        data = self.f.read(max(n, 0))
        self.pos += len(data)
        self.counter[0] += len(data)
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[:len(data)] = data
        return len(data)


_STORAGES = {"FloatStorage": torch.float32, "DoubleStorage": torch.float64, "HalfStorage": torch.float16,
             "BFloat16Storage": torch.bfloat16, "LongStorage": torch.int64, "IntStorage": torch.int32,
             "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
             "BoolStorage": torch.bool}


class _TensorRecord(pickle.Unpickler):
    """Reads a torch.save pickle of one plain tensor as ``(storage key, dtype, offset, size, stride)``
    without building it; anything else raises ``UnpicklingError`` (the caller then loads the blob whole)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *rest: (storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> Any:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError(f"persistent id {pid!r}")
        return pid[2], pid[1]  # (record key, dtype)


def _contiguous(size: tuple[int, ...], stride: tuple[int, ...]) -> bool:
    expect = 1
    for n, s in zip(reversed(size), reversed(stride)):
        if n != 1 and s != expect:
            return False
        expect *= n
    return True


class TorchDistCheckpoint:
    """One DCP / torch_dist iteration directory (``path``: it, or the ``--save`` directory above it).

    ``directory``, ``iteration``, ``common`` (``common.pt``'s dict, ``{}`` where there is none), ``args``
    (its ``args`` Namespace or None), ``keys()`` (the tensors), ``global_shape(key)``, ``dtype(key)``,
    ``read(key, index)``, ``objects()`` and ``read_object(key)`` (the saved objects); ``bytes_read`` counts every
    byte read from the ``.distcp`` files."""

    def __init__(self, path: str) -> None:
        if not os.path.isdir(path):
            raise CheckpointError(f"{path} is not a directory (pass a torch_dist --save directory or one "
                                  f"iter_XXXXXXX directory in it)")
        self.directory, it = resolve_iteration_dir(path)
        self.metadata = _load_metadata(os.path.join(self.directory, ".metadata"))
        self._tensors = {k: m for k, m in self.metadata.state_dict_metadata.items() if hasattr(m, "chunks")}
        self._storage = {(i.fqn, tuple(i.offset) if i.offset is not None else None): s
                         for i, s in self.metadata.storage_data.items()}
        self.common = self._load_common()
        self.args = self.common.get("args")
        self.iteration = self.common.get("iteration", it)
        self._counter = [0]
        self._layouts: dict[tuple[str, int], Optional[tuple[int, torch.dtype]]] = {}

    def _load_common(self) -> dict:
        path = os.path.join(self.directory, "common.pt")
        if not os.path.isfile(path):
            return {}
        from megazero.checkpoint.megatron_pickle import load_megatron_file

        try:
            common = load_megatron_file(path)
        except ValueError as e:
            raise CheckpointError(str(e)) from None
        except Exception as e:  # truncated zip / pickle
            raise CheckpointError(f"cannot read {path}: {type(e).__name__}: {e} (truncated or corrupt; re-copy "
                                  f"the checkpoint)") from None
        return common if isinstance(common, dict) else {}

    @property
    def bytes_read(self) -> int:
        return self._counter[0]

    def keys(self) -> list[str]:
        return sorted(self._tensors)

    def objects(self) -> list[str]:
        """The keys of the saved objects (DCP's byte entries: megatron-core's ShardedObjects)."""
        return sorted(k for k, m in self.metadata.state_dict_metadata.items() if not hasattr(m, "chunks"))

    def read_object(self, key: str) -> Any:
        """The object saved under ``key`` (a torch.save blob), unpickled with ``torch.load(weights_only=True)``:
        plain Python values and tensors only."""
        info = self._storage.get((key, None))
        if info is None:
            raise CheckpointError(f"{self.directory}/.metadata has no object {key!r}")
        path = os.path.join(self.directory, info.relative_path)
        try:
            with open(path, "rb") as f:
                blob = _Window(f, info.offset, info.length, self._counter).read()
            return torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except OSError as e:
            raise CheckpointError(f"cannot read {path}: {e}") from None
        except Exception as e:  # a garbled or non-plain pickle raises many types
            raise CheckpointError(f"{path}: the object {key} at byte {info.offset} is not a plain saved value "
                                  f"({type(e).__name__}: {e})") from None

    def _meta(self, key: str) -> Any:
        m = self._tensors.get(key)
        if m is None:
            raise CheckpointError(f"{self.directory}/.metadata has no tensor {key!r} (it has {len(self._tensors)} "
                                  f"tensors, e.g. {self.keys()[:4]}): was it saved from another model shape?")
        return m

    def global_shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._meta(key).size)

    def dtype(self, key: str) -> torch.dtype:
        return self._meta(key).properties.dtype

    def read(self, key: str, index: Index = ()) -> torch.Tensor:
        """The region ``index`` (ints and unit-step slices over the global tensor) of ``key``, reading only the
        chunks it overlaps and their rows it needs."""
        meta = self._meta(key)
        shape = tuple(meta.size)
        bounds, drop = _normalize(index, shape, key)
        out = torch.empty([b - a for a, b in bounds], dtype=meta.properties.dtype)
        covered = 0
        for chunk in meta.chunks:
            offs, sizes = tuple(chunk.offsets), tuple(chunk.sizes)
            lo = [max(a, o) for (a, _), o in zip(bounds, offs)]
            hi = [min(b, o + s) for (_, b), o, s in zip(bounds, offs, sizes)]
            if any(a >= b for a, b in zip(lo, hi)):
                continue
            info = self._storage.get((key, offs))
            if info is None:
                raise CheckpointError(f"{self.directory}/.metadata lists a chunk of {key} at {offs} but not where its "
                                      f"bytes are: the metadata is inconsistent; re-save the checkpoint")
            part = self._chunk(key, info, sizes, [a - o for a, o in zip(lo, offs)], [b - o for b, o in zip(hi, offs)])
            out[tuple(slice(a - s, b - s) for a, b, (s, _) in zip(lo, hi, bounds))] = part
            covered += math.prod(b - a for a, b in zip(lo, hi))
        if covered != out.numel():
            raise CheckpointError(f"{self.directory}: the chunks of {key} cover {covered} of the {out.numel()} "
                                  f"elements of {index}; the checkpoint is incomplete (a rank's save is missing)")
        return out[tuple(0 if d else slice(None) for d in drop)]

    def _chunk(self, key: str, info: Any, sizes: tuple[int, ...], lo: list[int], hi: list[int]) -> torch.Tensor:
        """The region ``[lo, hi)`` (per dimension, chunk-local) of the chunk of ``key`` stored at ``info``."""
        path = os.path.join(self.directory, info.relative_path)
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{path}: {key} is stored through transforms {info.transform_descriptors}, which "
                                  f"megazero does not read; re-save the checkpoint without them")
        try:
            f = open(path, "rb")
        except FileNotFoundError:
            raise CheckpointError(f"{path}, which holds {key}, is missing: copy every __*.distcp file of "
                                  f"{self.directory}") from None
        with f:
            end = info.offset + info.length
            if os.fstat(f.fileno()).st_size < end:
                raise CheckpointError(f"{path} is {os.fstat(f.fileno()).st_size} bytes but the chunk of {key} ends at "
                                      f"byte {end}: the file is truncated; re-copy it")
            window = _Window(f, info.offset, info.length, self._counter)
            region = self._region_in_place(window, path, key, sizes, lo, hi)
            if region is not None:
                return region
            window.seek(0)
            blob = window.read()
        try:
            t = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=True)
        except Exception as e:  # a garbled blob raises many types
            raise CheckpointError(f"{path}: the chunk of {key} at byte {info.offset} is not a readable tensor "
                                  f"({type(e).__name__}: {e}); the file is corrupt, re-copy it") from None
        if not isinstance(t, torch.Tensor) or tuple(t.shape) != sizes:
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise CheckpointError(f"{path}: the chunk of {key} holds {got}, not the {sizes} its metadata says: the "
                                  f"file does not belong to this .metadata; re-copy the checkpoint")
        return t[tuple(slice(a, b) for a, b in zip(lo, hi))]

    def _region_in_place(self, window: _Window, path: str, key: str, sizes: tuple[int, ...], lo: list[int],
                         hi: list[int]) -> Optional[torch.Tensor]:
        """The region ``[lo, hi)`` of a torch.save blob's tensor, reading only the bytes from its first element to
        its last; None when the blob is not one plain, contiguous, little-endian tensor of shape ``sizes``."""
        where = (path, window.start)
        if where not in self._layouts:
            self._layouts[where] = _blob_layout(window, path, key, sizes)
        layout = self._layouts[where]
        if layout is None:
            return None
        start, dtype = layout
        strides = [math.prod(sizes[d + 1:]) for d in range(len(sizes))]
        first = sum(a * st for a, st in zip(lo, strides))
        last = sum((b - 1) * st for b, st in zip(hi, strides))
        window.seek(start + first * dtype.itemsize)
        data = bytearray(window.read((last + 1 - first) * dtype.itemsize))
        flat = torch.frombuffer(data, dtype=dtype)
        return flat.as_strided([b - a for a, b in zip(lo, hi)], strides)


def _blob_layout(window: _Window, path: str, key: str, sizes: tuple[int, ...]) -> Optional[tuple[int, torch.dtype]]:
    """(byte in the window where element 0 of the blob's tensor is, dtype) when the torch.save blob in ``window``
    is one plain, contiguous, little-endian, stored (uncompressed) tensor of shape ``sizes``; else None."""
    try:
        zf = zipfile.ZipFile(window)
        names = zf.namelist()
        pkl = next(n for n in names if n.endswith("data.pkl"))
        prefix = pkl[:-len("data.pkl")]
        if prefix + "byteorder" in names and zf.read(prefix + "byteorder") != b"little":
            return None
        (record, dtype), offset, size, stride = _TensorRecord(io.BytesIO(zf.read(pkl))).load()
        zi = zf.getinfo(f"{prefix}data/{record}")
        window.seek(zi.header_offset)
        name_len, extra_len = struct.unpack("<HH", window.read(30)[26:30])
    except (zipfile.BadZipFile, pickle.UnpicklingError, StopIteration, KeyError, ValueError, TypeError,
            struct.error, EOFError):
        return None
    if size != sizes or not _contiguous(size, stride) or zi.compress_type != zipfile.ZIP_STORED:
        return None
    start = zi.header_offset + 30 + name_len + extra_len
    if (offset + math.prod(size)) * dtype.itemsize > zi.file_size or start + zi.file_size > window.length:
        raise CheckpointError(f"{path}: the chunk of {key} holds fewer bytes than the {sizes} tensor its "
                              f"metadata says; the file is truncated or corrupt, re-copy it")
    return start + offset * dtype.itemsize, dtype
