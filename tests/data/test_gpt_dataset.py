"""GPT samples: exact coverage of the token stream, determinism, caching, splits and blending."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from megazero.data.blended_dataset import BlendedDataset, build_blending_indices
from megazero.data.gpt_dataset import (
    GPTDataset, build_indices, build_train_valid_test_datasets, parse_data_prefix, split_ranges,
)
from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder


def make_dataset(prefix, lengths, first_token=0, dtype=np.int32):
    """Documents of the given lengths whose tokens count up from ``first_token``, so a
    token identifies its position in the corpus."""
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype)
    t = first_token
    for n in lengths:
        b.add_item(np.arange(t, t + n))
        b.end_document()
        t += n
    b.finalize(f"{prefix}.idx")
    return IndexedDataset(prefix)


LENGTHS = [5, 17, 0, 3, 40, 1, 9, 0, 26, 12, 7, 30]  # includes empty documents


@pytest.fixture
def corpus(tmp_path):
    return make_dataset(tmp_path / "c", LENGTHS)


def stream(ds: GPTDataset) -> np.ndarray:
    return np.concatenate([ds.indexed[int(d)] for d in ds.doc_idx]).astype(np.int64)


@pytest.mark.parametrize("seq_length", [1, 4, 7, 16, 149])
def test_one_epoch_covers_the_token_stream(corpus, tmp_path, seq_length):
    docs = np.arange(len(LENGTHS))
    total = sum(LENGTHS)
    ds = GPTDataset(corpus, docs, seq_length, num_samples=1, seed=3, cache_dir=tmp_path / "cache")
    assert len(ds) == (total - 1) // seq_length  # a whole epoch, as Megatron
    assert sorted(ds.doc_idx.tolist()) == docs.tolist()  # every document exactly once
    s = stream(ds)
    for k in range(len(ds)):
        np.testing.assert_array_equal(ds.sample(k), s[k * seq_length: (k + 1) * seq_length + 1])
    # Shuffled access: a permutation of the samples, each seq_length + 1 int64 tokens.
    assert sorted(ds.shuffle_idx.tolist()) == list(range(len(ds)))
    for i in range(len(ds)):
        item = ds[i]["text"]
        assert item.dtype == np.int64 and len(item) == seq_length + 1
        np.testing.assert_array_equal(item, ds.sample(int(ds.shuffle_idx[i])))
    # Consecutive samples share exactly their boundary token; together they cover the epoch.
    joined = np.concatenate([ds.sample(k)[:-1] for k in range(len(ds))] + [ds.sample(len(ds) - 1)[-1:]])
    np.testing.assert_array_equal(joined, s[: len(joined)])
    assert len(s) - len(joined) < seq_length


def test_several_epochs(corpus, tmp_path):
    docs = np.arange(2, 10)
    tokens = sum(LENGTHS[2:10])
    seq = 8
    per_epoch = (tokens - 1) // seq
    # Samples cross epoch boundaries: 3 epochs give (3 * 91 - 1) // 8 = 34 samples, so 36 need 4.
    assert (tokens, per_epoch, (3 * tokens - 1) // seq) == (91, 11, 34)
    ds = GPTDataset(corpus, docs, seq, num_samples=36, seed=1, cache_dir=tmp_path)
    epochs = len(ds.doc_idx) // len(docs)
    assert epochs == 4 and len(ds) == (4 * tokens - 1) // seq
    # Few samples come from the last epoch, so it is shuffled on its own (Megatron).
    last = ds.doc_idx[-len(docs):]
    assert sorted(last.tolist()) == docs.tolist()
    assert sorted(ds.doc_idx.tolist()) == sorted(docs.tolist() * epochs)
    s = stream(ds)
    for k in range(0, len(ds), 5):
        np.testing.assert_array_equal(ds.sample(k), s[k * seq: (k + 1) * seq + 1])


def test_deterministic_and_seed_dependent(corpus, tmp_path):
    docs = np.arange(len(LENGTHS))
    a = GPTDataset(corpus, docs, 4, 60, seed=7, cache_dir=tmp_path / "a")
    b = GPTDataset(corpus, docs, 4, 60, seed=7, cache_dir=tmp_path / "b")
    c = GPTDataset(corpus, docs, 4, 60, seed=8, cache_dir=tmp_path / "c")
    for name in ("doc_idx", "sample_idx", "shuffle_idx"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert not np.array_equal(a.shuffle_idx, c.shuffle_idx)
    assert all(np.array_equal(a[i]["text"], b[i]["text"]) for i in range(len(a)))


def test_indices_are_cached_and_reused(corpus, tmp_path):
    docs = np.arange(len(LENGTHS))
    cache = tmp_path / "cache"
    first = GPTDataset(corpus, docs, 4, 30, seed=1, cache_dir=str(cache))
    assert not first.loaded_from_cache
    files = sorted(os.listdir(cache))
    assert len(files) == 4 and all(f.endswith((".npy", ".json")) for f in files)
    mtimes = {f: os.stat(cache / f).st_mtime_ns for f in files}
    time.sleep(0.01)
    second = GPTDataset(corpus, docs, 4, 30, seed=1, cache_dir=str(cache))
    assert second.loaded_from_cache
    assert {f: os.stat(cache / f).st_mtime_ns for f in files} == mtimes
    np.testing.assert_array_equal(first.shuffle_idx, second.shuffle_idx)
    assert all(np.array_equal(first[i]["text"], second[i]["text"]) for i in range(len(first)))
    # Any parameter change is a different cache entry.
    GPTDataset(corpus, docs, 5, 30, seed=1, cache_dir=str(cache))
    GPTDataset(corpus, docs[1:], 4, 30, seed=1, cache_dir=str(cache))
    assert len(os.listdir(cache)) == 12
    # Default location: next to the data.
    default = GPTDataset(corpus, docs, 4, 30, seed=1)
    assert os.path.dirname(default.cache_paths["doc_idx"]) == str(tmp_path / "cache" / "GPTDataset_indices")


def test_index_build_is_fast_for_a_million_tokens(tmp_path):
    rng = np.random.default_rng(0)
    sizes = rng.integers(1, 400, size=5000).astype(np.int32)  # ~1M tokens
    start = time.perf_counter()
    doc_idx, sample_idx, shuffle_idx = build_indices(sizes, np.arange(5000), 128, 3 * 7800, seed=0)
    assert time.perf_counter() - start < 2.0
    assert len(shuffle_idx) >= 3 * 7800 and sample_idx.shape == (len(shuffle_idx) + 1, 2)


def test_empty_split_and_bad_arguments(corpus, tmp_path):
    with pytest.raises(ValueError, match="no tokens"):
        GPTDataset(corpus, np.array([2, 7]), 4, 10, seed=0, cache_dir=tmp_path)
    with pytest.raises(ValueError, match="no documents"):
        GPTDataset(corpus, np.array([], dtype=np.int64), 4, 10, seed=0, cache_dir=tmp_path)


def test_split_ranges():
    assert split_ranges("969,30,1", 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges("98,2", 100) == [(0, 98), (98, 100), (100, 100)]
    assert split_ranges("100,0,0", 7) == [(0, 7), (7, 7), (7, 7)]
    # megatron-core rounds the cumulative boundaries
    assert split_ranges("969,30,1", 12_345) == [(0, 11962), (11962, 12333), (12333, 12345)]
    assert split_ranges("90,5,5", 10) == [(0, 9), (9, 10), (10, 10)]  # a validation set exists
    assert split_ranges("1,1,1", 10) == [(0, 3), (3, 7), (7, 10)]
    # the legacy Megatron-LM rule, kept for continuing old runs
    assert split_ranges("969,30,1", 12_345, "legacy")[0] == (0, 11963)
    assert split_ranges("90,5,5", 10, "legacy")[1] == (10, 10)  # no validation set
    assert split_ranges("1,1,1", 10, "legacy") == [(0, 4), (4, 7), (7, 10)]  # rounding error off the start
    assert split_ranges("969/30/1", 12) == split_ranges("969,30,1", 12)
    for bad in ("", "a,b", "1,2,3,4", "-1,2", "0,0,0"):
        with pytest.raises(ValueError):
            split_ranges(bad, 10)


def test_build_train_valid_test(tmp_path):
    make_dataset(tmp_path / "d", [20] * 50)
    train, valid, test = build_train_valid_test_datasets(
        [str(tmp_path / "d")], "80,20,0", seq_length=16, seed=1234,
        train_valid_test_num_samples=(100, 10, 5), cache_dir=str(tmp_path / "cache"))
    assert test is None  # no documents
    assert len(train) >= 100 and len(valid) >= 10
    assert set(train.doc_idx.tolist()) == set(range(40)) and set(valid.doc_idx.tolist()) == set(range(40, 50))
    assert train[0]["text"].shape == (17,)
    _, _, none = build_train_valid_test_datasets([str(tmp_path / "d")], "1,1,1", 16, 1, (10, 0, 0),
                                                 cache_dir=str(tmp_path / "cache"))
    assert none is None  # 0 samples requested


def test_megatron_blending_rule_exact():
    # megatron-core helpers.cpp: argmax_j of w_j * max(n, 1) - count_j, first on ties (hand-computed)
    dataset_index, sample_index = build_blending_indices([0.3, 0.7], 10)
    assert dataset_index.tolist() == [1, 0, 1, 1, 0, 1, 1, 0, 1, 1]
    assert sample_index.tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6]
    tij, _ = build_blending_indices([0.3, 0.7], 10, "tijdeman")
    assert int(np.argmax(tij != dataset_index)) == 7  # where the two rules first part
    a, _ = build_blending_indices([0.2, 0.8], 5)
    b, _ = build_blending_indices([0.2, 0.8], 5, "tijdeman")
    assert a.tolist()[:2] == [1, 0] and int(np.argmax(a != b)) == 1
    from megazero.data.blended_dataset import blended_sample_counts, blended_size

    assert blended_sample_counts([0.3, 0.7], 1000) == [302, 704]  # ceil(ceil(w n) * 1.005)
    assert blended_size([0.3, 0.7], 1001) == 301 + 701
    with pytest.raises(ValueError, match="blend rule"):
        build_blending_indices([0.5, 0.5], 4, "random")


def _drift(weights, rule, size=5000):
    dataset_index, _ = build_blending_indices(weights, size, rule)
    n = np.arange(1, size + 1)
    return max(np.abs(np.cumsum(dataset_index == j) - w * n).max() for j, w in enumerate(weights))


def test_tijdeman_option_is_measurably_tighter():
    # the figures quoted in megazero/data/blended_dataset.py
    assert (round(_drift([0.3, 0.7], "megatron"), 2), round(_drift([0.3, 0.7], "tijdeman"), 2)) == (0.7, 0.5)
    assert (round(_drift([0.01, 0.09, 0.9], "megatron"), 2), round(_drift([0.01, 0.09, 0.9], "tijdeman"), 2)) == (1.3, 0.7)


@pytest.mark.parametrize("weights", [[0.3, 0.7], [0.5, 0.3, 0.2], [0.01, 0.09, 0.9],
                                     [0.05, 0.6, 0.05, 0.1, 0.2], [1.0]])
def test_blending_is_within_one_sample_at_every_prefix(weights):
    size = 5000
    dataset_index, sample_index = build_blending_indices(weights, size, "tijdeman")
    n = np.arange(1, size + 1)
    for j, w in enumerate(weights):
        took = np.cumsum(dataset_index == j)
        assert np.abs(took - w * n).max() <= 1.0
        # Each dataset's samples are used in order 0, 1, 2, ...
        np.testing.assert_array_equal(sample_index[dataset_index == j], np.arange(took[-1]))


def test_blending_random_weights():
    rng = np.random.default_rng(0)
    for _ in range(20):
        k = int(rng.integers(2, 7))
        w = rng.random(k) ** 3
        w /= w.sum()
        dataset_index, _ = build_blending_indices(w, 600, "tijdeman")
        n = np.arange(1, 601)
        bound = 1 - 1 / (2 * k - 2) + 1e-9
        for j in range(k):
            assert np.abs(np.cumsum(dataset_index == j) - w[j] * n).max() <= bound


def test_blended_datasets(tmp_path):
    make_dataset(tmp_path / "a", [30] * 40, first_token=0)
    make_dataset(tmp_path / "b", [30] * 40, first_token=10_000)
    prefixes = ["0.3", str(tmp_path / "a"), "0.7", str(tmp_path / "b")]
    train, valid, test = build_train_valid_test_datasets(
        prefixes, "90,10,0", seq_length=8, seed=5, train_valid_test_num_samples=(1000, 20, 0),
        cache_dir=str(tmp_path / "cache"))
    assert isinstance(train, BlendedDataset) and len(train) == 300 + 700 and test is None
    from_b = np.array([train[i]["text"][0] >= 10_000 for i in range(1000)])
    np.testing.assert_array_equal(from_b, build_blending_indices([0.3, 0.7], 1000)[0] == 1)
    assert all(len(train[i]["text"]) == 9 for i in range(0, 1000, 37))
    # Components got megatron-core's sizes: ceil(ceil(w n) * 1.005) samples asked for.
    assert [d.num_samples for d in train.datasets] == [302, 704]
    again, _, _ = build_train_valid_test_datasets(
        prefixes, "90,10,0", 8, 5, (1000, 20, 0), cache_dir=str(tmp_path / "cache"))
    assert again.loaded_from_cache and all(d.loaded_from_cache for d in again.datasets)
    np.testing.assert_array_equal(again[123]["text"], train[123]["text"])


def test_parse_data_prefix():
    assert parse_data_prefix(["/d/x"]) == (["/d/x"], None)
    assert parse_data_prefix(["A", "B"]) == (["A", "B"], None)  # unweighted: by size
    assert parse_data_prefix(["1", "A", "3", "B"]) == (["A", "B"], [0.25, 0.75])
    with pytest.raises(ValueError, match="alternate"):
        parse_data_prefix(["0.3", "A", "B"])
    with pytest.raises(ValueError, match="numbers"):
        parse_data_prefix(["A", "0.3", "B", "0.7"])
