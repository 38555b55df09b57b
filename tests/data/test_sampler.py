"""Data-parallel sampling: disjoint rank shards covering the global batch, exact resume."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from megazero.data.gpt_dataset import GPTDataset
from megazero.data.indexed_dataset import IndexedDataset, IndexedDatasetBuilder
from megazero.data.sampler import MegatronPretrainingSampler, build_pretraining_data_loader


def batches(total, consumed, micro, rank, size, drop_last=True):
    return list(MegatronPretrainingSampler(total, consumed, micro, rank, size, drop_last))


@pytest.mark.parametrize("micro, dp", [(1, 1), (3, 4), (2, 3), (5, 2)])
def test_rank_shards_are_disjoint_and_cover_the_global_batch(micro, dp):
    total = 100
    per_rank = [batches(total, 0, micro, r, dp) for r in range(dp)]
    steps = total // (micro * dp)
    assert all(len(b) == steps for b in per_rank)
    for step in range(steps):
        shards = [per_rank[r][step] for r in range(dp)]
        assert all(len(s) == micro for s in shards)
        union = [i for s in shards for i in s]
        assert len(set(union)) == len(union)  # disjoint
        assert union == list(range(step * micro * dp, (step + 1) * micro * dp))  # = global batch
        for r, s in enumerate(shards):  # rank r owns the r-th contiguous slice
            assert s == list(range(step * micro * dp + r * micro, step * micro * dp + (r + 1) * micro))
    # Tensor-parallel peers pass the same DP rank and so get identical batches.
    assert batches(total, 0, micro, dp - 1, dp) == per_rank[dp - 1]
    assert len(MegatronPretrainingSampler(total, 0, micro, 0, dp)) == steps


def test_resume_reproduces_the_remaining_stream():
    micro, dp, total = 2, 3, 97
    for rank in range(dp):
        full = batches(total, 0, micro, rank, dp)
        for step in range(len(full) + 1):
            consumed = step * micro * dp
            assert batches(total, consumed, micro, rank, dp) == full[step:]


def test_drop_last_false_yields_the_partial_chunk():
    # 10 samples, global batch 4: two full steps, then samples 8, 9 for rank 0 only.
    assert batches(10, 0, 2, 0, 2, drop_last=False)[-1] == [8, 9]
    assert batches(10, 0, 2, 1, 2, drop_last=False)[-1] == []
    assert len(MegatronPretrainingSampler(10, 0, 2, 0, 2, drop_last=False)) == 3
    assert batches(10, 0, 2, 0, 2) == [[0, 1], [4, 5]]


@pytest.mark.parametrize("kwargs, message", [
    (dict(total_samples=0), "total_samples"),
    (dict(consumed_samples=11), "consumed_samples"),
    (dict(micro_batch_size=0), "micro_batch_size"),
    (dict(data_parallel_rank=2), "data_parallel_rank"),
])
def test_invalid_arguments(kwargs, message):
    args = dict(total_samples=10, consumed_samples=0, micro_batch_size=2,
                data_parallel_rank=0, data_parallel_size=2)
    with pytest.raises(ValueError, match=message):
        MegatronPretrainingSampler(**{**args, **kwargs})


@pytest.fixture
def gpt(tmp_path):
    b = IndexedDatasetBuilder(tmp_path / "d.bin", np.uint16)
    for i in range(30):
        b.add_item(np.arange(i, i + 25) % 500)
        b.end_document()
    b.finalize(tmp_path / "d.idx")
    return GPTDataset(IndexedDataset(tmp_path / "d"), np.arange(30), 16, 40, seed=0, cache_dir=str(tmp_path / "c"))


def test_data_loader_batches_and_resume(gpt):
    loader = build_pretraining_data_loader(gpt, 0, micro_batch_size=4, data_parallel_rank=1, data_parallel_size=2)
    got = list(loader)
    assert len(got) == len(loader) == len(gpt) // 8
    first = got[0]["text"]
    assert first.dtype == torch.long and first.shape == (4, 17)
    np.testing.assert_array_equal(first.numpy(), np.stack([gpt[i]["text"] for i in range(4, 8)]))
    resumed = build_pretraining_data_loader(gpt, consumed_samples=16, micro_batch_size=4,
                                            data_parallel_rank=1, data_parallel_size=2)
    for a, b in zip(got[2:], resumed, strict=True):
        assert torch.equal(a["text"], b["text"])
    assert build_pretraining_data_loader(None, 0, 4, 0, 1) is None


def test_data_loader_with_a_worker_process(gpt):
    import pickle

    assert len(pickle.dumps(gpt)) < 2000  # indices travel as cache paths, not copies
    loader = build_pretraining_data_loader(gpt, 0, 4, 0, 1, num_workers=1)
    batch = next(iter(loader))["text"]
    np.testing.assert_array_equal(batch.numpy(), np.stack([gpt[i]["text"] for i in range(4)]))
