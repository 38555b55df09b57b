"""JSONL -> Megatron ``<prefix>_<key>_document.bin/.idx``, streamed and parallel.

Conventions (kept identical for every worker count, so outputs are byte-identical):

* one JSON line = one document = one sequence; document i of every key's output is
  the i-th accepted line;
* an empty text is kept as a zero-length document (``[eod]`` with ``append_eod``), so
  the alignment above holds;
* blank lines (only whitespace) are not documents; they are skipped and counted;
* a bad line (invalid UTF-8 or JSON, not an object, missing key, non-string value,
  untokenizable text) stops the run with ``file:line: reason``, unless
  ``skip_bad_lines``, which skips, counts and reports it.

Memory stays flat: lines are read lazily and at most a fixed number of them are in
flight between the reader, the worker pool and the writer.
"""

from __future__ import annotations

import functools
import glob
import gzip
import json
import logging
import multiprocessing
import os
import threading
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator

import numpy as np

from megazero.data.indexed_dataset import AtomicDatasetWriter, best_fitting_dtype
from megazero.data.tokenizer import Tokenizer, build_tokenizer
from megazero.utils.progress import Progress

_INPUT_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz")


class PreprocessError(Exception):
    """A user-facing preprocessing failure (bad flags, bad input); message says the fix."""


class BadLineError(PreprocessError):
    def __init__(self, file: str, line: int, reason: str):
        self.file, self.line, self.reason = file, line, reason
        super().__init__(f"{file}:{line}: {reason} (pass --skip-bad-lines to skip such lines)")


@dataclass
class PreprocessConfig:
    """Options of ``tools/preprocess_data.py`` (same names as its flags)."""

    inputs: list[str]
    output_prefix: str
    json_keys: list[str] = field(default_factory=lambda: ["text"])
    tokenizer_type: str = "SentencePieceTokenizer"
    tokenizer_model: str | None = None
    vocab_file: str | None = None
    merge_file: str | None = None
    vocab_size: int | None = None
    append_eod: bool = False
    workers: int = 1
    chunksize: int = 64
    log_interval: int = 1000
    skip_bad_lines: bool = False
    progress: bool = True


@dataclass
class PreprocessStats:
    """What a run read and wrote."""

    outputs: dict[str, str]  # json key -> dataset prefix
    documents: int = 0
    tokens: dict[str, int] = field(default_factory=dict)
    input_bytes: int = 0
    seconds: float = 0.0
    bad_lines: int = 0
    blank_lines: int = 0
    bad_examples: list[str] = field(default_factory=list)
    dtype: str = ""

    def summary(self) -> str:
        secs = max(self.seconds, 1e-9)
        ntok = sum(self.tokens.values())
        lines = [
            f"documents: {self.documents:,}  tokens: {ntok:,}  input: {self.input_bytes / 1e6:.2f} MB  "
            f"time: {self.seconds:.2f} s",
            f"throughput: {self.documents / secs:,.0f} docs/s  {self.input_bytes / 1e6 / secs:.2f} MB/s  "
            f"{ntok / secs:,.0f} tokens/s",
        ]
        if self.blank_lines:
            lines.append(f"blank lines skipped: {self.blank_lines:,}")
        if self.bad_lines:
            lines.append(f"bad lines skipped: {self.bad_lines:,}, e.g.:")
            lines += [f"  {e}" for e in self.bad_examples]
        for key, prefix in self.outputs.items():
            lines.append(f"wrote {prefix}.bin/.idx ({self.tokens.get(key, 0):,} tokens, {self.dtype})")
        return "\n".join(lines)


def resolve_inputs(inputs: Iterable[str]) -> list[str]:
    """Expand files, globs and directories (their *.jsonl[.gz]/*.json[.gz]) in order."""
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(str(p) for p in Path(item).iterdir()
                           if p.is_file() and p.name.endswith(_INPUT_SUFFIXES))
            if not found:
                raise PreprocessError(f"--input directory '{item}' holds no {'/'.join(_INPUT_SUFFIXES)} files")
            files += found
        elif os.path.isfile(item):
            files.append(item)
        elif glob.has_magic(item):
            found = sorted(p for p in glob.glob(item) if os.path.isfile(p))
            if not found:
                raise PreprocessError(f"--input pattern '{item}' matches no files")
            files += found
        else:
            raise PreprocessError(f"--input '{item}' does not exist")
    if not files:
        raise PreprocessError("no --input given")
    return files


def iter_raw_lines(files: Iterable[str]) -> Iterator[tuple[str, int, bytes]]:
    """Yield ``(file, 1-based line number, raw bytes)`` lazily; .gz is decompressed.
    An unreadable or truncated file raises PreprocessError naming it."""
    for path in files:
        opener = gzip.open if path.endswith(".gz") else open
        lineno = 0
        try:
            with opener(path, "rb") as f:
                for lineno, raw in enumerate(f, 1):
                    yield path, lineno, raw
        except (OSError, EOFError, zlib.error) as e:
            raise PreprocessError(f"{path}: cannot read after line {lineno}: {e}") from None


def parse_line(raw: bytes, keys: list[str]) -> dict[str, str] | None:
    """Raw JSONL line -> ``{key: text}``; None for a blank line; ValueError saying what is wrong."""
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"invalid UTF-8 at byte offset {e.start} ({raw[e.start:e.start + 4]!r}); "
                         f"re-encode the file as UTF-8") from None
    if not line.strip():
        return None
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"invalid JSON: {e.msg} at column {e.colno}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")
    out = {}
    for key in keys:
        if key not in obj:
            raise ValueError(f"missing key '{key}'; the line has keys {sorted(obj)}: "
                             f"choose one with --json-keys")
        value = obj[key]
        if not isinstance(value, str):
            raise ValueError(f"key '{key}' holds a {type(value).__name__}, expected a string")
        out[key] = value
    return out


@dataclass(frozen=True)
class _TokenizerSpec:
    tokenizer_type: str
    tokenizer_model: str | None
    vocab_file: str | None
    merge_file: str | None
    vocab_size: int | None

    def build(self) -> Tokenizer:
        return build_tokenizer(self.tokenizer_type, tokenizer_model=self.tokenizer_model,
                               vocab_file=self.vocab_file, merge_file=self.merge_file,
                               vocab_size=self.vocab_size)


@functools.lru_cache(maxsize=4)
def _cached_tokenizer(spec: _TokenizerSpec) -> Tokenizer:
    # One tokenizer per worker process, built on its first task (tasks carry only the spec).
    return spec.build()


@dataclass(frozen=True)
class _Job:
    spec: _TokenizerSpec
    keys: tuple[str, ...]
    append_eod: bool
    dtype: str


def _encode(job: _Job, item: tuple[str, int, bytes]):
    """Worker: one raw line -> ("ok", [tokens per key], nbytes) | ("blank", None, nbytes)
    | ("bad", (file, line, reason), nbytes)."""
    path, lineno, raw = item
    try:
        texts = parse_line(raw, list(job.keys))
        if texts is None:
            return ("blank", None, len(raw))
        tok = _cached_tokenizer(job.spec)
        arrays = []
        for key in job.keys:
            ids = tok.tokenize(texts[key])
            if job.append_eod:
                ids.append(tok.eod)
            arrays.append(np.asarray(ids, dtype=job.dtype))
        return ("ok", arrays, len(raw))
    except ValueError as e:
        return ("bad", (path, lineno, str(e)), len(raw))


def _bounded(items: Iterator, slots: threading.Semaphore, stop: threading.Event) -> Iterator:
    """Hand out an item only when a slot is free: Pool.imap would otherwise read the
    whole input ahead of the workers. ``stop`` lets the feeding thread exit early."""
    for item in items:
        while not slots.acquire(timeout=0.1):
            if stop.is_set():
                return
        if stop.is_set():
            return
        yield item


def preprocess(config: PreprocessConfig) -> PreprocessStats:
    """Tokenize ``config.inputs`` into one dataset per JSON key; see the module docstring."""
    files = resolve_inputs(config.inputs)
    if not config.json_keys or len(set(config.json_keys)) != len(config.json_keys):
        raise PreprocessError(f"--json-keys must be distinct and non-empty, got {config.json_keys}")
    spec = _TokenizerSpec(config.tokenizer_type, config.tokenizer_model, config.vocab_file,
                          config.merge_file, config.vocab_size)
    try:
        tokenizer = spec.build()  # fail fast on bad tokenizer flags, before any worker starts
    except (ValueError, OSError) as e:
        raise PreprocessError(str(e)) from None
    dtype = np.dtype(best_fitting_dtype(tokenizer.vocab_size))
    job = _Job(spec, tuple(config.json_keys), config.append_eod, dtype.name)
    outputs = {k: f"{config.output_prefix}_{k}_document" for k in config.json_keys}
    stats = PreprocessStats(outputs=outputs, tokens={k: 0 for k in config.json_keys}, dtype=dtype.name)

    start = time.perf_counter()
    writers: list[AtomicDatasetWriter] = []
    bar = Progress("tokenized", unit="documents", logger=logging.getLogger(__name__), enabled=config.progress)
    pool = slots = None
    stop = threading.Event()
    try:
        for key in config.json_keys:
            writers.append(AtomicDatasetWriter(outputs[key], dtype))
        lines = iter_raw_lines(files)
        if config.workers <= 1:
            results = map(functools.partial(_encode, job), lines)
        else:
            chunksize = max(1, config.chunksize)
            slots = threading.Semaphore(chunksize * config.workers * 4)
            # fork: workers start in milliseconds and inherit the imported modules.
            methods = multiprocessing.get_all_start_methods()
            ctx = multiprocessing.get_context("fork" if "fork" in methods else None)
            pool = ctx.Pool(config.workers)
            results = pool.imap(functools.partial(_encode, job), _bounded(lines, slots, stop), chunksize)
        for result in results:
            if slots is not None:
                slots.release()
            stats.input_bytes += result[-1]
            if result[0] == "ok":
                for key, writer, arr in zip(config.json_keys, writers, result[1]):
                    writer.builder.add_item(arr)
                    writer.builder.end_document()
                    stats.tokens[key] += arr.size
                stats.documents += 1
                rate = None
                if stats.documents % max(1, config.log_interval) == 0:
                    secs = max(time.perf_counter() - start, 1e-9)
                    rate = f"{stats.input_bytes / 1e6 / secs:.2f} MB/s, {sum(stats.tokens.values()) / secs:,.0f} tok/s"
                bar.update(1, rate)
            elif result[0] == "blank":
                stats.blank_lines += 1
            else:
                if not config.skip_bad_lines:
                    raise BadLineError(*result[1])
                stats.bad_lines += 1
                if len(stats.bad_examples) < 5:
                    stats.bad_examples.append("{}:{}: {}".format(*result[1]))
        for w in writers:
            w.commit()
        bar.close()
    finally:
        stop.set()
        if pool is not None:
            pool.terminate()
            pool.join()
        bar.close(completed=False)  # no-op when closed above
        for w in writers:
            w.discard()
    stats.seconds = time.perf_counter() - start
    return stats
