"""Megatron-LM ``MMapIndexedDataset`` files: a token ``.bin`` plus an ``.idx`` index.

Byte layout of ``<prefix>.idx`` (all little endian), identical to Megatron-LM so that
datasets are interchangeable in both directions::

    9 bytes   magic  b"MMIDIDX\\x00\\x00"
    <Q        version (1)
    <B        dtype code of the tokens in .bin (see DTYPE_CODES)
    <Q        S = number of sequences
    <Q        D = number of entries of the document index (documents + 1)
    int32[S]  sequence lengths, in tokens
    int64[S]  sequence byte offsets into .bin
    int64[D]  document index: document d is sequences [doc_idx[d], doc_idx[d+1])

``<prefix>.bin`` is the tokens of all sequences back to back, nothing else.
Reading is zero-copy: both files are memory mapped and items are views.
"""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from pathlib import Path

import numpy as np

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
#: Megatron's ``DType`` enum codes.
DTYPE_CODES: dict[int, type] = {
    1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32,
    5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16,
}
_CODE_OF = {np.dtype(t): c for c, t in DTYPE_CODES.items()}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D


class IndexedDatasetError(ValueError):
    """A .bin/.idx pair is missing, truncated, foreign or inconsistent."""

    user_facing = True  # the message says what was wrong and how to fix it: no traceback


def best_fitting_dtype(vocab_size: int | None) -> type:
    """uint16 when every id fits (as Megatron: vocab < 65500), else int32."""
    return np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32


def dtype_code(dtype) -> int:
    """Megatron dtype code of a numpy dtype."""
    try:
        return _CODE_OF[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {np.dtype(dtype)} cannot be stored; use one of "
                         f"{[np.dtype(t).name for t in DTYPE_CODES.values()]}") from None


def idx_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.idx"


def bin_path(prefix: str | os.PathLike) -> str:
    return f"{prefix}.bin"


def dataset_exists(prefix: str | os.PathLike) -> bool:
    return os.path.isfile(idx_path(prefix)) and os.path.isfile(bin_path(prefix))


class _Index:
    """The parsed, validated, memory-mapped ``.idx`` file."""

    def __init__(self, path: str):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(_HEADER.size)
        if len(head) < len(MAGIC) or head[: len(MAGIC)] != MAGIC:
            raise IndexedDatasetError(
                f"{path}: not a Megatron MMapIndexedDataset index (magic {head[:9]!r}, expected "
                f"{MAGIC!r}); was it written by another tool, or is it the .bin file?")
        if len(head) < _HEADER.size:
            raise IndexedDatasetError(f"{path}: truncated index: {size} bytes, header alone needs {_HEADER.size}")
        _, version, code, n_seq, n_doc = _HEADER.unpack(head)
        if version != VERSION:
            raise IndexedDatasetError(f"{path}: index version {version}, only version {VERSION} is supported")
        if code not in DTYPE_CODES:
            raise IndexedDatasetError(f"{path}: unknown dtype code {code} (known: {sorted(DTYPE_CODES)})")
        self.dtype = np.dtype(DTYPE_CODES[code])
        expected = _HEADER.size + n_seq * 4 + n_seq * 8 + n_doc * 8
        if size != expected:
            what = "truncated" if size < expected else "has trailing bytes"
            raise IndexedDatasetError(
                f"{path}: index {what}: {size} bytes, but its header ({n_seq} sequences, "
                f"{n_doc} document-index entries) implies {expected}; rebuild the dataset")
        if n_doc < 1:
            raise IndexedDatasetError(f"{path}: empty document index (needs at least the leading 0)")
        # np.memmap cannot map a zero-length region; the header always exists, so map all.
        buf = np.memmap(path, dtype=np.uint8, mode="r")
        off = _HEADER.size
        self.sizes = np.frombuffer(buf, dtype=np.int32, count=n_seq, offset=off)
        off += n_seq * 4
        self.pointers = np.frombuffer(buf, dtype=np.int64, count=n_seq, offset=off)
        off += n_seq * 8
        self.doc_idx = np.frombuffer(buf, dtype=np.int64, count=n_doc, offset=off)
        self._validate()

    def _validate(self) -> None:
        sizes, ptrs, doc = self.sizes, self.pointers, self.doc_idx
        if doc[0] != 0 or doc[-1] != len(sizes) or np.any(np.diff(doc) < 0):
            raise IndexedDatasetError(
                f"{self.path}: corrupt document index (must rise from 0 to {len(sizes)})")
        if len(sizes) and (np.any(sizes < 0) or ptrs[0] != 0 or np.any(
                ptrs[1:] != ptrs[:-1] + sizes[:-1].astype(np.int64) * self.dtype.itemsize)):
            raise IndexedDatasetError(
                f"{self.path}: corrupt index: sequence offsets do not match sequence lengths")

    @property
    def data_bytes(self) -> int:
        """Size the .bin must have."""
        if not len(self.sizes):
            return 0
        return int(self.pointers[-1]) + int(self.sizes[-1]) * self.dtype.itemsize


class IndexedDataset:
    """Read-only, memory-mapped Megatron dataset: item ``i`` is sequence ``i``'s tokens.

    With the files ``tools/preprocess_data.py`` writes, a sequence is a document
    (one JSON line). Items are zero-copy numpy views into the mapped .bin.
    """

    def __init__(self, path_prefix: str | os.PathLike):
        self.path_prefix = str(path_prefix)
        ipath, bpath = idx_path(self.path_prefix), bin_path(self.path_prefix)
        for p in (ipath, bpath):
            if not os.path.isfile(p):
                raise IndexedDatasetError(
                    f"{p} not found: a dataset prefix names '<prefix>.idx' and '<prefix>.bin' "
                    f"(e.g. data/corpus_text_document, without extension)")
        self._index = _Index(ipath)
        actual = os.path.getsize(bpath)
        if actual != self._index.data_bytes:
            what = "truncated" if actual < self._index.data_bytes else "longer than its index says"
            raise IndexedDatasetError(
                f"{bpath}: data file {what}: {actual} bytes, index {ipath} expects "
                f"{self._index.data_bytes}; the pair does not belong together or a write was cut short")
        self._bin = (np.memmap(bpath, dtype=self.dtype, mode="r") if actual
                     else np.empty(0, dtype=self.dtype))

    # Memory maps would be pickled by value (copying the whole file) when a DataLoader
    # worker receives the dataset, so pickle the path and re-map instead.
    def __getstate__(self) -> dict:
        return {"path_prefix": self.path_prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path_prefix"])

    @property
    def dtype(self) -> np.dtype:
        return self._index.dtype

    @property
    def sizes(self) -> np.ndarray:
        """Tokens per sequence (int32)."""
        return self._index.sizes

    @property
    def pointers(self) -> np.ndarray:
        """Byte offset of each sequence in the .bin (int64)."""
        return self._index.pointers

    @property
    def doc_idx(self) -> np.ndarray:
        """Document boundaries as sequence indices (int64, len = documents + 1)."""
        return self._index.doc_idx

    @property
    def num_tokens(self) -> int:
        return int(self.sizes.sum(dtype=np.int64))

    def __len__(self) -> int:
        return len(self._index.sizes)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self.get(j) for j in range(*i.indices(len(self)))]
        return self.get(i)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` (to its end if no length)."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sequence {i} out of range for {self.path_prefix} ({n} sequences)")
        i = int(i) % n
        size = int(self._index.sizes[i])
        if length is None:
            length = size - offset
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"tokens [{offset}, {offset + length}) outside sequence {i} of length {size}")
        start = int(self._index.pointers[i]) // self.dtype.itemsize + offset
        return np.asarray(self._bin[start: start + length])


class IndexedDatasetBuilder:
    """Writes a dataset: ``add_item`` per sequence, ``end_document`` after each document,
    ``add_index`` to append a whole existing dataset, ``finalize`` to write the .idx.

    The .bin is streamed to disk; only per-sequence lengths are kept in memory.
    """

    def __init__(self, bin_path: str | os.PathLike, dtype=np.int32):
        self.dtype = np.dtype(dtype)
        self._code = dtype_code(self.dtype)
        self.bin_path = str(bin_path)
        self._out = open(self.bin_path, "wb")
        self._sizes = array("q")
        self._doc_idx = array("q", [0])

    def add_item(self, tokens) -> None:
        """Append one sequence (any int array-like; must fit the dtype)."""
        arr = np.asarray(tokens)
        if arr.dtype != self.dtype:
            if arr.size and arr.dtype.kind in "iu":
                info = np.iinfo(self.dtype) if self.dtype.kind in "iu" else None
                if info is not None and (arr.min() < info.min or arr.max() > info.max):
                    raise ValueError(f"token ids [{arr.min()}, {arr.max()}] do not fit {self.dtype}")
            arr = arr.astype(self.dtype)
        self._out.write(arr.tobytes(order="C"))
        self._sizes.append(arr.size)

    def end_document(self) -> None:
        """Close the current document (the sequences added since the last call)."""
        self._doc_idx.append(len(self._sizes))

    def add_index(self, other_prefix: str | os.PathLike) -> None:
        """Append all sequences and documents of the dataset at ``other_prefix``."""
        other = IndexedDataset(other_prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"cannot merge {other_prefix} (dtype {other.dtype}) into a {self.dtype} "
                             f"dataset; all inputs must be preprocessed with the same tokenizer")
        base = len(self._sizes)
        self._sizes.extend(other.sizes.astype(np.int64).tolist())
        self._doc_idx.extend((other.doc_idx[1:] + base).tolist())
        with open(bin_path(other_prefix), "rb") as f:
            shutil.copyfileobj(f, self._out, 16 << 20)

    def finalize(self, idx_path: str | os.PathLike) -> None:
        """Close the .bin and write the .idx (see module docstring for the layout)."""
        self._out.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int64) if len(self._sizes) else np.zeros(0, np.int64)
        if len(sizes) and sizes.max() > np.iinfo(np.int32).max:
            raise ValueError("a sequence longer than 2**31-1 tokens cannot be indexed")
        pointers = np.zeros(len(sizes), dtype=np.int64)
        if len(sizes) > 1:
            np.cumsum(sizes[:-1] * self.dtype.itemsize, out=pointers[1:])
        doc_idx = np.frombuffer(self._doc_idx, dtype=np.int64)
        with open(idx_path, "wb") as f:
            f.write(_HEADER.pack(MAGIC, VERSION, self._code, len(sizes), len(doc_idx)))
            f.write(sizes.astype("<i4").tobytes())
            f.write(pointers.astype("<i8").tobytes())
            f.write(doc_idx.astype("<i8").tobytes())

    def abort(self) -> None:
        """Close and delete the partial .bin."""
        self._out.close()
        Path(self.bin_path).unlink(missing_ok=True)


class AtomicDatasetWriter:
    """An ``IndexedDatasetBuilder`` writing ``<prefix>.bin/.idx`` all-or-nothing.

    Writes go to ``<prefix>.bin.tmp``/``.idx.tmp``; ``commit`` removes any old .idx,
    renames the .bin, then the .idx. A crash at any point therefore never leaves a
    .bin/.idx pair that looks complete but is not (a reader needs the .idx).
    Leaving the ``with`` block without ``commit`` deletes the temporary files.
    """

    def __init__(self, prefix: str | os.PathLike, dtype):
        self.prefix = str(prefix)
        self._bin_tmp = bin_path(self.prefix) + ".tmp"
        self._idx_tmp = idx_path(self.prefix) + ".tmp"
        Path(self.prefix).parent.mkdir(parents=True, exist_ok=True)
        self.builder = IndexedDatasetBuilder(self._bin_tmp, dtype)
        self._done = False

    def commit(self) -> None:
        self.builder.finalize(self._idx_tmp)
        Path(idx_path(self.prefix)).unlink(missing_ok=True)
        os.replace(self._bin_tmp, bin_path(self.prefix))
        os.replace(self._idx_tmp, idx_path(self.prefix))
        self._done = True

    def discard(self) -> None:
        if not self._done:
            self.builder.abort()
            Path(self._idx_tmp).unlink(missing_ok=True)
            self._done = True

    def __enter__(self) -> "AtomicDatasetWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.discard()
