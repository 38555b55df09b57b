"""GPT pretraining samples over a Megatron ``IndexedDataset``, Megatron-style.

The documents of a split are concatenated into one token stream, epoch after epoch,
each epoch in a fresh random document order (the *document index*). Sample ``k`` is
stream tokens ``[k*seq_length, (k+1)*seq_length]`` -- ``seq_length + 1`` tokens, so
inputs and shifted labels come from one sample, and consecutive samples share one
boundary token. The *sample index* stores, for every sample boundary, (position in
the document index, offset in that document); the *shuffle index* permutes samples.

All three are built with numpy in a few vectorized passes and cached as ``.npy``
files named by a hash of everything they depend on, so every rank and every restart
loads identical indices instead of rebuilding them.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megazero.data.indexed_dataset import IndexedDataset

# Megatron's threshold: when the last epoch would contribute fewer than this fraction
# of an epoch's samples, it is shuffled separately so its (incomplete) documents do not
# get mixed into -- and under-represented within -- the earlier full epochs.
_SEPARATE_LAST_EPOCH_FRACTION = 0.80
_INDEX_NAMES = ("doc_idx", "sample_idx", "shuffle_idx")


def default_cache_dir(path_prefix: str) -> str:
    """Where indices are cached when no cache dir is given: next to the data."""
    return os.path.join(os.path.dirname(os.path.abspath(path_prefix)), "cache", "GPTDataset_indices")


def _save_npy_atomic(path: str, array: np.ndarray) -> None:
    # A unique temporary name makes concurrent builders (e.g. every rank at once) safe.
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        np.save(f, array, allow_pickle=False)
    os.replace(tmp, path)


def _hash(description: dict) -> str:
    return hashlib.md5(json.dumps(description, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class _Plan:
    tokens_per_epoch: int
    num_epochs: int
    separate_last_epoch: bool
    samples_before_last_epoch: int


def _plan(tokens_per_epoch: int, seq_length: int, num_samples: int | None) -> _Plan:
    if num_samples is None:  # exactly one epoch (megatron-core's num_samples=None)
        return _Plan(tokens_per_epoch, 1, False, 0)
    # Smallest number of epochs with (epochs * tokens - 1) // seq_length >= num_samples
    # (the "- 1": every sample needs one extra token for the shifted label).
    num_epochs = max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))
    before_last = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length if num_epochs > 1 else 0
    separate = False
    if num_epochs > 1:
        from_last = num_samples - before_last
        per_epoch = (tokens_per_epoch - 1) // seq_length
        separate = from_last < int(_SEPARATE_LAST_EPOCH_FRACTION * per_epoch)
    return _Plan(tokens_per_epoch, num_epochs, separate, before_last)


def build_indices(
    sizes: np.ndarray, documents: np.ndarray, seq_length: int, num_samples: int | None, seed: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Document, sample and shuffle indices (see module docstring).

    ``sizes`` are the token counts of all sequences, ``documents`` the sequence ids of
    this split. Returns ``doc_idx`` (int32/int64 ids, one epoch after another),
    ``sample_idx`` (int64 ``[n + 1, 2]``: doc_idx position, token offset) and
    ``shuffle_idx`` (a permutation of the ``n >= num_samples`` samples).
    """
    documents = np.asarray(documents)
    tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
    if tokens_per_epoch < 1:
        raise ValueError("the split has no tokens: it has only empty documents")
    plan = _plan(tokens_per_epoch, seq_length, num_samples)
    rng = np.random.RandomState(seed)

    def epochs(n: int) -> np.ndarray:
        idx = np.tile(documents, n)
        rng.shuffle(idx)
        return idx

    if plan.separate_last_epoch:
        doc_idx = np.concatenate([epochs(plan.num_epochs - 1), epochs(1)])
    else:
        doc_idx = epochs(plan.num_epochs)

    # Token position of every document's start in the stream, then locate each sample
    # boundary k*seq_length with one binary search (side="right" skips empty documents).
    starts = np.zeros(len(doc_idx) + 1, dtype=np.int64)
    np.cumsum(sizes[doc_idx], dtype=np.int64, out=starts[1:])
    total_samples = (int(starts[-1]) - 1) // seq_length
    boundaries = np.arange(total_samples + 1, dtype=np.int64) * seq_length
    position = np.searchsorted(starts, boundaries, side="right") - 1
    sample_idx = np.stack([position, boundaries - starts[position]], axis=1)

    dtype = np.uint32 if total_samples < np.iinfo(np.uint32).max - 1 else np.int64
    split = plan.samples_before_last_epoch if plan.separate_last_epoch else total_samples
    first = np.arange(split, dtype=dtype)
    rng.shuffle(first)
    last = np.arange(split, total_samples, dtype=dtype)
    rng.shuffle(last)
    shuffle_idx = np.concatenate([first, last])
    return doc_idx, sample_idx, shuffle_idx


class GPTDataset:
    """Fixed-length GPT samples from ``documents`` of ``indexed``; ``dataset[i]`` is
    ``{"text": int64 array of seq_length + 1 tokens}``.

    ``len(dataset) >= num_samples``: the indices cover whole epochs (as Megatron);
    ``num_samples=None`` means exactly one epoch. ``loaded_from_cache`` tells whether the
    indices came from the cache. With ``vocab_size``, a sample holding a token id outside
    ``[0, vocab_size)`` raises ``ValueError`` naming the dataset and document (checked on
    read: one max over the sample, so corrupt data cannot train silently at any tp).
    """

    def __init__(
        self,
        indexed: IndexedDataset,
        documents: np.ndarray,
        seq_length: int,
        num_samples: int | None,
        seed: int,
        cache_dir: str | None = None,
        name: str = "train",
        vocab_size: int | None = None,
    ):
        if seq_length < 1:
            raise ValueError(f"seq_length must be >= 1, got {seq_length}")
        self.vocab_size = vocab_size
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        documents = np.asarray(documents, dtype=np.int64)
        if len(documents) == 0:
            raise ValueError(f"{name} split of {indexed.path_prefix} has no documents")
        self.indexed, self.documents = indexed, documents
        self.seq_length, self.num_samples, self.seed, self.name = seq_length, num_samples, seed, name
        self.description = {
            "class": "GPTDataset", "format": 1,
            "path_prefix": os.path.abspath(indexed.path_prefix),
            # Content fingerprint: a re-preprocessed dataset at the same path gets new indices.
            "num_sequences": len(indexed), "num_tokens": indexed.num_tokens,
            "documents": hashlib.md5(documents.tobytes()).hexdigest(),
            "num_documents": len(documents),
            "seq_length": seq_length, "num_samples": num_samples, "seed": seed,
        }
        self.cache_dir = cache_dir or default_cache_dir(indexed.path_prefix)
        key = _hash(self.description)
        base = os.path.join(self.cache_dir, f"{key}-GPTDataset-{name}")
        self.cache_paths = {n: f"{base}-{n}.npy" for n in _INDEX_NAMES}
        self._description_path = f"{base}-description.json"
        self.loaded_from_cache = os.path.isfile(self._description_path) and all(
            os.path.isfile(p) for p in self.cache_paths.values())
        if self.loaded_from_cache:
            arrays = [np.load(self.cache_paths[n], mmap_mode="r", allow_pickle=False) for n in _INDEX_NAMES]
        else:
            arrays = build_indices(indexed.sizes, documents, seq_length, num_samples, seed)
            self._save(arrays)
        self.doc_idx, self.sample_idx, self.shuffle_idx = arrays

    def _save(self, arrays) -> None:
        try:
            Path(self.cache_dir).mkdir(parents=True, exist_ok=True)
            for n, a in zip(_INDEX_NAMES, arrays):
                _save_npy_atomic(self.cache_paths[n], a)
            tmp = f"{self._description_path}.tmp{os.getpid()}"
            Path(tmp).write_text(json.dumps(self.description, indent=1, sort_keys=True))
            os.replace(tmp, self._description_path)  # last: marks the cache entry complete
        except OSError as e:
            raise OSError(f"cannot write dataset index cache in '{self.cache_dir}' ({e}); "
                          f"pass a writable cache_dir") from None

    # DataLoader workers receive the dataset pickled; the (possibly large) indices are
    # re-mapped from their cache files instead of being copied through the pickle.
    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        for n in _INDEX_NAMES:
            del state[n]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        for n in _INDEX_NAMES:
            setattr(self, n, np.load(self.cache_paths[n], mmap_mode="r", allow_pickle=False))

    def __len__(self) -> int:
        return len(self.shuffle_idx)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not 0 <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {self.name} dataset of {len(self)}")
        return {"text": self.sample(int(self.shuffle_idx[idx]))}

    def sample(self, k: int) -> np.ndarray:
        """Unshuffled sample ``k``: stream tokens ``[k*seq, (k+1)*seq]`` as int64."""
        (d0, o0), (d1, o1) = self.sample_idx[k], self.sample_idx[k + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        get, doc = self.indexed.get, self.doc_idx
        if d0 == d1:
            parts = [get(int(doc[d0]), o0, o1 - o0 + 1)]
        else:
            parts = [get(int(doc[d0]), o0)]
            parts += [get(int(doc[d])) for d in range(d0 + 1, d1)]
            parts.append(get(int(doc[d1]), 0, o1 + 1))
        out = np.concatenate(parts).astype(np.int64)
        assert len(out) == self.seq_length + 1, (k, len(out))
        if self.vocab_size is not None and len(out) and (out.max() >= self.vocab_size or out.min() < 0):
            self._bad_token(d0, d1)
        return out

    def _bad_token(self, d0: int, d1: int) -> None:
        for d in range(d0, d1 + 1):
            doc = int(self.doc_idx[d])
            tokens = self.indexed.get(doc)
            bad = tokens[(tokens >= self.vocab_size) | (tokens < 0)]
            if len(bad):
                raise ValueError(
                    f"dataset {self.indexed.path_prefix} ({self.name} split): document {doc} holds token id "
                    f"{int(bad[0])}, outside the tokenizer's vocabulary [0, {self.vocab_size}); the data was "
                    f"preprocessed with another tokenizer (re-run tools/preprocess_data.py with this one)")


SPLIT_NAMES = ("train", "valid", "test")


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` (or ``"969/30/1"``, fewer parts padded with 0) -> 3 fractions."""
    try:
        parts = [float(s) for s in split.replace("/", ",").split(",") if s.strip()]
    except (AttributeError, ValueError):
        raise ValueError(f"split must look like '969,30,1', got {split!r}") from None
    if not 1 <= len(parts) <= 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"split needs 1-3 non-negative weights with a positive sum, got {split!r}")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def split_ranges(split: str, num_documents: int, rule: str = "megatron-core") -> list[tuple[int, int]]:
    """Contiguous document ranges ``[start, end)`` of train/valid/test.

    ``"megatron-core"`` (default): the cumulative fractions ``[0, f0, f0+f1, 1]`` are each
    rounded (``int(round(b * N))``), as megatron-core's split matrix does: ``969,30,1`` on
    12,345 documents gives train [0, 11962); ``90,5,5`` on 10 gives valid [9, 10).
    ``"legacy"``: Megatron-LM's older rule, each part rounded on its own and the error taken
    off the start (train [0, 11963) above), for continuing a run that used it.
    """
    fractions = parse_split(split)
    if rule == "legacy":
        bounds = [0]
        for fraction in fractions:
            bounds.append(bounds[-1] + int(round(fraction * num_documents)))
        excess = bounds[-1] - num_documents
        bounds = [0] + [b - excess for b in bounds[1:]]
        return [(bounds[i], bounds[i + 1]) for i in range(3)]
    if rule != "megatron-core":
        raise ValueError(f"split rule {rule!r} is not 'megatron-core' or 'legacy'")
    cumulative = [0.0]
    for fraction in fractions:  # summed left to right, as megatron-core (same float rounding)
        cumulative.append(cumulative[-1] + fraction)
    out = []
    for lo, hi in zip(cumulative[:-1], cumulative[1:]):
        if hi <= lo:  # megatron-core's None: no such split
            out.append((int(round(lo * num_documents)),) * 2)
            continue
        out.append((int(round(lo * num_documents)), int(round(hi * num_documents))))
    return out


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def parse_data_prefix(data_prefix: list[str] | str) -> tuple[list[str], list[float] | None]:
    """Megatron's ``--data-path`` forms -> ``(prefixes, weights)``.

    ``["w1", "P1", "w2", "P2", ...]``: normalized weights. ``["P"]`` or ``["P1", "P2", ...]``
    (no numbers): weights ``None``, which megatron-core reads as "each prefix in proportion
    to its size" (every dataset used once, one epoch).
    """
    if isinstance(data_prefix, (str, os.PathLike)):
        data_prefix = [str(data_prefix)]
    items = [str(x) for x in data_prefix]
    if not items:
        raise ValueError("data_prefix is empty")
    numeric = [_is_number(x) for x in items]
    if not any(numeric):
        return items, None
    if len(items) % 2:
        raise ValueError(f"data_prefix with weights must alternate weight and path "
                         f"('0.3 A 0.7 B'), got {items}")
    if not all(numeric[0::2]) or any(numeric[1::2]):
        raise ValueError(f"data_prefix weights must be numbers ('0.3 A 0.7 B'), got {items}")
    from megazero.data.blended_dataset import normalize_weights

    return items[1::2], normalize_weights([float(w) for w in items[0::2]])


def build_train_valid_test_datasets(
    data_prefix: list[str] | None,
    split: str,
    seq_length: int,
    seed: int,
    train_valid_test_num_samples: tuple[int, int, int],
    cache_dir: str | None = None,
    *,
    train_data_path: list[str] | None = None,
    valid_data_path: list[str] | None = None,
    test_data_path: list[str] | None = None,
    blend_rule: str = "megatron",
    split_rule: str = "megatron-core",
    vocab_size: int | None = None,
) -> tuple:
    """(train, valid, test) datasets as megatron-core's BlendedMegatronDatasetBuilder builds them.

    ``data_prefix`` + ``split``: every prefix is split into document ranges and each split
    blends the prefixes' ranges. Or ``train_data_path`` / ``valid_data_path`` /
    ``test_data_path`` (Megatron's --train-data-path etc., each in the --data-path forms):
    each split from its own prefixes, whole. Per split:

    * one prefix without weight: a GPTDataset of the requested samples;
    * weights: components of ``ceil(ceil(w * n) * 1.005)`` samples blended by megatron-core's
      rule (``blend_rule``) into ``sum(ceil(w * n))`` samples;
    * several prefixes without weights: each component one epoch, blended in proportion to
      the components' sizes into ``min(n, total)`` samples.

    An entry is None when its split has no documents or 0 samples are requested.
    ``cache_dir`` is Megatron's --data-cache-path (default: beside the data). ``vocab_size``
    makes reading a token id outside the vocabulary an error naming the dataset and document.
    """
    if len(train_valid_test_num_samples) != 3:
        raise ValueError(f"train_valid_test_num_samples needs 3 numbers, got {train_valid_test_num_samples}")
    per_split = [train_data_path, valid_data_path, test_data_path]
    if any(p for p in per_split):
        if data_prefix:
            raise ValueError("give either data_prefix (with split) or train/valid/test data paths, not both")
        blends = [parse_data_prefix(p) if p else None for p in per_split]
        plans = []
        for s, blend in enumerate(blends):
            if blend is None:
                plans.append(None)
                continue
            indexed = [IndexedDataset(p) for p in blend[0]]
            ranges = [[(0, len(d)) if i == s else (0, 0) for i in range(3)] for d in indexed]
            # megatron-core: a split given by one prefix is that dataset, weight or not
            plans.append((indexed, ranges, blend[1] if len(indexed) > 1 else None))
    else:
        if not data_prefix:
            raise ValueError("no data: give data_prefix or train/valid/test data paths")
        prefixes, weights = parse_data_prefix(data_prefix)
        indexed = [IndexedDataset(p) for p in prefixes]
        ranges = [split_ranges(split, len(d), split_rule) for d in indexed]
        plans = [(indexed, ranges, weights)] * 3
    out = []
    for s, name in enumerate(SPLIT_NAMES):
        n = int(train_valid_test_num_samples[s] or 0)
        if plans[s] is None or n <= 0:
            out.append(None)
            continue
        indexed, ranges, weights = plans[s]
        out.append(_build_split(indexed, [r[s] for r in ranges], weights, n, name, seq_length, seed, cache_dir,
                                blend_rule, vocab_size))
    return tuple(out)


def _build_split(indexed, ranges, weights, n, name, seq_length, seed, cache_dir, blend_rule, vocab_size):
    from megazero.data.blended_dataset import BlendedDataset, blended_sample_counts, blended_size

    def component(d: IndexedDataset, r: tuple[int, int], num: int | None) -> GPTDataset | None:
        if r[1] <= r[0]:
            return None
        return GPTDataset(d, np.arange(r[0], r[1], dtype=np.int64), seq_length, num, seed,
                          cache_dir=cache_dir, name=name, vocab_size=vocab_size)

    if all(r[1] <= r[0] for r in ranges):
        return None
    if len(indexed) == 1 and weights is None:
        return component(indexed[0], ranges[0], n)
    blend_cache = cache_dir or default_cache_dir(indexed[0].path_prefix)
    if weights is not None:
        counts = blended_sample_counts(weights, n)
        parts = [(component(d, r, c), w) for d, r, c, w in zip(indexed, ranges, counts, weights)]
        if any(p is None and w > 0 for p, w in parts):
            empty = [d.path_prefix for (p, w), d in zip(parts, indexed) if p is None and w > 0]
            raise ValueError(f"the {name} split of {', '.join(empty)} has no documents but a positive blend weight")
        parts = [(p, w) for p, w in parts if p is not None and w > 0]
        size = blended_size([w for _, w in parts], n)
    else:
        parts = [(p, None) for p in (component(d, r, None) for d, r in zip(indexed, ranges)) if p is not None]
        if not parts:
            return None
        parts = [(p, float(len(p))) for p, _ in parts]
        size = min(n, int(sum(w for _, w in parts)))
    if not parts:
        return None
    return BlendedDataset([p for p, _ in parts], [w for _, w in parts], size, cache_dir=blend_cache, rule=blend_rule)
