"""Megatron's data options in the dataset builder: per-split data paths, unweighted
multi-prefix blends (by size), the index cache path, one-epoch components, megatron-core's
split and blend sizes end to end, and token ids outside the vocabulary."""

from __future__ import annotations

import numpy as np
import pytest

from megazero.data.blended_dataset import BlendedDataset, build_blending_indices
from megazero.data.gpt_dataset import GPTDataset, build_train_valid_test_datasets
from tests.data.test_gpt_dataset import make_dataset


def test_90_5_5_on_10_documents_builds_a_validation_set(tmp_path):
    make_dataset(tmp_path / "d", [50] * 10)
    train, valid, test = build_train_valid_test_datasets([str(tmp_path / "d")], "90,5,5", 8, 1, (10, 4, 4),
                                                         cache_dir=str(tmp_path / "c"))
    assert valid is not None and valid.documents.tolist() == [9] and test is None
    assert train.documents.tolist() == list(range(9))


def test_separate_train_valid_test_paths(tmp_path):
    for name, first in (("tr", 0), ("va", 10_000), ("te", 20_000)):
        make_dataset(tmp_path / name, [30] * 6, first_token=first)
    train, valid, test = build_train_valid_test_datasets(
        None, "969,30,1", 8, 1, (20, 5, 5), cache_dir=str(tmp_path / "cache"),
        train_data_path=[str(tmp_path / "tr")], valid_data_path=[str(tmp_path / "va")],
        test_data_path=["1.0", str(tmp_path / "te")])  # one weighted prefix is that dataset, whole
    assert isinstance(train, GPTDataset) and train.documents.tolist() == list(range(6))
    assert all(train[i]["text"].max() < 10_000 for i in range(20))
    assert all(10_000 <= valid[i]["text"].min() < 20_000 for i in range(5))
    assert isinstance(test, GPTDataset) and test[0]["text"].min() >= 20_000
    _, none, _ = build_train_valid_test_datasets(None, "1", 8, 1, (5, 5, 0), cache_dir=str(tmp_path / "cache"),
                                                 train_data_path=[str(tmp_path / "tr")])
    assert none is None
    with pytest.raises(ValueError, match="not both"):
        build_train_valid_test_datasets([str(tmp_path / "tr")], "1", 8, 1, (5, 0, 0),
                                        train_data_path=[str(tmp_path / "tr")])


def test_unweighted_prefixes_blend_by_size(tmp_path):
    make_dataset(tmp_path / "a", [40] * 10, first_token=0)  # 400 tokens -> 49 samples of 8
    make_dataset(tmp_path / "b", [40] * 30, first_token=100_000)  # 1200 tokens -> 149 samples
    train, _, _ = build_train_valid_test_datasets([str(tmp_path / "a"), str(tmp_path / "b")], "100,0,0", 8, 1,
                                                  (150, 0, 0), cache_dir=str(tmp_path / "cache"))
    assert isinstance(train, BlendedDataset)
    assert [len(d) for d in train.datasets] == [49, 149]  # each component exactly one epoch
    assert [d.num_samples for d in train.datasets] == [None, None]
    assert len(train) == 150  # min(requested, 49 + 149)
    np.testing.assert_array_equal(train.dataset_index, build_blending_indices([49, 149], 150)[0])
    everything, _, _ = build_train_valid_test_datasets([str(tmp_path / "a"), str(tmp_path / "b")], "100,0,0", 8,
                                                       1, (10_000, 0, 0), cache_dir=str(tmp_path / "cache"))
    assert len(everything) == 198  # capped at the sum: every sample of both, once
    assert sorted(np.bincount(everything.dataset_index).tolist()) == [49, 149]


def test_data_cache_path_is_used(tmp_path):
    make_dataset(tmp_path / "d", [30] * 6)
    cache = tmp_path / "elsewhere"
    train, _, _ = build_train_valid_test_datasets([str(tmp_path / "d")], "1", 8, 1, (5, 0, 0), cache_dir=str(cache))
    assert all(p.startswith(str(cache)) for p in train.cache_paths.values())
    assert any(cache.iterdir()) and not (tmp_path / "cache").exists()


def test_token_outside_vocabulary_names_dataset_and_document(tmp_path):
    make_dataset(tmp_path / "d", [10, 10, 10, 10], first_token=0)  # ids 0..39; document 3 holds 30..39
    train, _, _ = build_train_valid_test_datasets([str(tmp_path / "d")], "1", 8, 1, (4, 0, 0),
                                                  cache_dir=str(tmp_path / "c"), vocab_size=30)
    with pytest.raises(ValueError, match=r"dataset .*/d \(train split\): document 3 holds token id 3\d"):
        for i in range(len(train)):
            train[i]
    ok, _, _ = build_train_valid_test_datasets([str(tmp_path / "d")], "1", 8, 1, (4, 0, 0),
                                               cache_dir=str(tmp_path / "c"), vocab_size=40)
    for i in range(len(ok)):
        ok[i]
