"""Verified partial reads of safetensors shard files.

At 13B a resume must not hash (or read) a whole checkpoint on one rank. So the
manifest records, for every shard file, the sha256 of its header and of
fixed-size chunks of its data region; a rank that reads part of a file reads
whole chunks, checks each one against the manifest, and copies out the bytes
it needs. Every byte a rank uses is verified, and a rank never reads a chunk
it does not use. ``bytes_read`` counts what came off the disk.

The safetensors format is simple enough to parse here (8-byte little-endian
header length, JSON header, raw data), which lets us read byte ranges without
mapping or loading whole files.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from typing import Optional

import torch

from megazero.utils.safetensors_dtypes import DTYPE_OF_CODE

__all__ = ["CheckpointError", "digest_file", "ShardFile", "ReadCounter", "fsync_path"]

# Bounds of the verification chunk: 256 chunks per file at most (a small manifest), no chunk
# larger than 64 MiB (the memory a reading rank holds besides its own state), 4 KiB at least.
_MAX_CHUNKS, _MAX_CHUNK, _MIN_CHUNK = 256, 64 << 20, 4096




class CheckpointError(RuntimeError):
    """A checkpoint that is missing, truncated, tampered with, or does not fit the model."""

    user_facing = True  # the message says what was wrong and how to fix it: no traceback


class ReadCounter:
    """Bytes and files one rank read from a checkpoint (the per-rank cost of a resume)."""

    def __init__(self) -> None:
        self.bytes = 0
        self.files: set[str] = set()


def fsync_path(path: str) -> None:
    """Flush a file or directory to stable storage (a directory fsync makes renames in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _chunk_bytes(data_len: int) -> int:
    size = -(-data_len // _MAX_CHUNKS)
    size = -(-size // _MIN_CHUNK) * _MIN_CHUNK
    return max(_MIN_CHUNK, min(_MAX_CHUNK, size))


def _read_header(f, path: str) -> tuple[int, bytes]:
    raw = f.read(8)
    if len(raw) < 8:
        raise CheckpointError(f"cannot read {path}: {len(raw)} bytes, not a safetensors file (truncated?)")
    (n,) = struct.unpack("<Q", raw)
    if n > 1 << 30:
        raise CheckpointError(f"cannot read {path}: header length {n} is implausible (not a megazero shard?)")
    header = f.read(n)
    if len(header) < n:
        raise CheckpointError(f"cannot read {path}: header is truncated ({len(header)} of {n} bytes)")
    return 8 + n, header


def digest_file(path: str) -> dict:
    """Manifest entry of one file, in one pass: whole-file sha256 and size, and for a
    safetensors file also the header's and every data chunk's sha256."""
    whole = hashlib.sha256()
    size = os.path.getsize(path)
    entry: dict = {"size": size}
    with open(path, "rb") as f:
        if path.endswith(".safetensors"):
            data_offset, header = _read_header(f, path)
            whole.update(struct.pack("<Q", data_offset - 8))
            whole.update(header)
            chunk = _chunk_bytes(size - data_offset)
            shas = []
            while True:
                block = f.read(chunk)
                if not block:
                    break
                whole.update(block)
                shas.append(hashlib.sha256(block).hexdigest())
            entry.update(header_sha256=hashlib.sha256(header).hexdigest(), data_offset=data_offset,
                         chunk_bytes=chunk, chunks=shas)
        else:
            for block in iter(lambda: f.read(1 << 20), b""):
                whole.update(block)
    entry["sha256"] = whole.hexdigest()
    return entry


def sha256_file(path: str, counter: Optional[ReadCounter] = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
            if counter is not None:
                counter.bytes += len(block)
    return h.hexdigest()


def _mismatch(path: str, what: str) -> CheckpointError:
    return CheckpointError(f"checkpoint file {path} does not match its sha256 in manifest.json ({what}): it was "
                           "truncated or modified; restore it or load an earlier iteration")


class ShardFile:
    """One safetensors shard: its header, and verified reads of element ranges of its fp32 tensors.

    ``entry`` is the file's manifest entry (None: no verification, e.g. a directory
    written by ``save_zero_state`` alone). An entry without chunk digests (an older
    manifest) is verified as a whole file before the first read.
    """

    def __init__(self, path: str, entry: Optional[dict], counter: ReadCounter) -> None:
        self.path, self.entry, self.counter = path, entry, counter
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        if entry is not None and "size" in entry and os.path.getsize(path) != entry["size"]:
            raise _mismatch(path, f"size {os.path.getsize(path)} instead of {entry['size']}")
        self._whole_checked = entry is None or "chunks" in entry
        with open(path, "rb") as f:
            self.data_offset, header = _read_header(f, path)
        counter.bytes += self.data_offset
        counter.files.add(path)
        if entry is not None and "header_sha256" in entry and hashlib.sha256(header).hexdigest() != entry["header_sha256"]:
            raise _mismatch(path, "header")
        try:
            parsed = json.loads(header)
            self.metadata = parsed.pop("__metadata__", {}) or {}
            self.meta = json.loads(self.metadata["megazero"]) if "megazero" in self.metadata else None
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"cannot read {path}: bad header ({e}); not a megazero shard?") from None
        self.tensors = parsed
        self.data_len = os.path.getsize(path) - self.data_offset
        self.chunk = entry["chunk_bytes"] if entry is not None and "chunk_bytes" in entry else _chunk_bytes(self.data_len)
        for name, info in parsed.items():
            lo, hi = info["data_offsets"]
            if hi > self.data_len:
                raise CheckpointError(f"cannot read {path}: tensor {name} ends at byte {hi} of a {self.data_len}-byte "
                                      "data region (truncated file?)")

    def keys(self) -> list[str]:
        return list(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        code = self.tensors[name]["dtype"]
        if code not in DTYPE_OF_CODE:  # integers too: an HF import reads MXFP4's packed uint8 experts
            raise CheckpointError(f"{self.path}: tensor {name} has dtype {code}, which megazero does not read")
        return DTYPE_OF_CODE[code]

    def tensor(self, name: str) -> torch.Tensor:
        """A whole tensor, any dtype of ``DTYPE_OF_CODE``, read with plain reads (no mmap: the pages read do not
        stay resident in this process)."""
        info = self.tensors.get(name)
        if info is None:
            raise CheckpointError(f"{self.path} has no tensor {name}")
        lo, hi = info["data_offsets"]
        buf = bytearray(hi - lo)
        with open(self.path, "rb") as f:
            f.seek(self.data_offset + lo)
            if f.readinto(buf) < len(buf):
                raise CheckpointError(f"cannot read {self.path}: tensor {name} is truncated")
        self.counter.bytes += len(buf)
        if not buf:
            return torch.empty(self.shape(name), dtype=self.dtype(name))
        return torch.frombuffer(buf, dtype=self.dtype(name)).view(self.shape(name))

    def _chunk(self, f, c: int) -> memoryview:
        f.seek(self.data_offset + c * self.chunk)
        data = bytearray(min(self.chunk, self.data_len - c * self.chunk))
        got = f.readinto(data)
        self.counter.bytes += got
        if got < len(data):
            raise CheckpointError(f"cannot read {self.path}: file ended inside data chunk {c} (truncated?)")
        if self.entry is not None and "chunks" in self.entry:
            shas = self.entry["chunks"]
            if c >= len(shas) or hashlib.sha256(data).hexdigest() != shas[c]:
                raise _mismatch(self.path, f"data chunk {c}")
        return memoryview(data)

    def read(self, requests: list[tuple[str, int, int, torch.Tensor]]) -> None:
        """Fill each ``dest`` (1-D, any device) with elements ``[lo, hi)`` of fp32 tensor ``name``.

        Each chunk touched is read (and verified) once, whatever the number of requests in it.
        """
        if not requests:
            return
        if not self._whole_checked:
            digest = sha256_file(self.path, self.counter)
            if digest != self.entry["sha256"]:
                raise _mismatch(self.path, "whole file")
            self._whole_checked = True
        ranges = []
        for name, lo, hi, dest in requests:
            info = self.tensors.get(name)
            if info is None:
                raise CheckpointError(f"{self.path} has no tensor {name}: written for another model or layout")
            if info["dtype"] != "F32":
                raise CheckpointError(f"{self.path}: tensor {name} is {info['dtype']}, megazero shards hold F32")
            start = info["data_offsets"][0]
            ranges.append((start + 4 * lo, start + 4 * hi, dest))
        ranges.sort(key=lambda r: r[0])
        cache: dict[int, memoryview] = {}
        with open(self.path, "rb") as f:
            for b0, b1, dest in ranges:
                first, last = b0 // self.chunk, (b1 - 1) // self.chunk
                for c in [c for c in cache if c < first]:
                    del cache[c]
                pos = 0
                for c in range(first, last + 1):
                    if c not in cache:
                        cache[c] = self._chunk(f, c)
                    base = c * self.chunk
                    piece = cache[c][max(b0, base) - base:min(b1, base + len(cache[c])) - base]
                    n = len(piece) // 4
                    if n:
                        dest[pos:pos + n].copy_(torch.frombuffer(piece, dtype=torch.float32))
                    pos += n
