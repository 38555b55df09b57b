"""`--data-path A B` without weights: the trainer blends the prefixes in proportion to their sizes, as
megatron-core does (weights None), not equally."""

import numpy as np

from megazero.data import IndexedDatasetBuilder
from megazero.config import parse_args
from megazero.training.loop import build_datasets


def _corpus(prefix: str, docs: int, seed: int) -> None:
    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for _ in range(docs):
        builder.add_item(rng.integers(0, 99, int(rng.integers(10, 60))).astype(np.uint16))
        builder.end_document()
    builder.finalize(prefix + ".idx")


def test_unweighted_prefixes_blend_by_size(tmp_path):
    a, b = str(tmp_path / "small"), str(tmp_path / "large")
    _corpus(a, 30, 0)
    _corpus(b, 150, 1)
    base = ("--model-preset gpt-tiny --seq-length 16 --max-position-embeddings 16 --micro-batch-size 2 "
            "--global-batch-size 8 --lr 1e-3 --tokenizer-type NullTokenizer --vocab-size 100 --split 100,0,0 "
            "--eval-iters 0").split()
    # Far more samples than both prefixes hold: the blend is one epoch of each, in proportion to size.
    cfg = parse_args(base + ["--train-iters", "500", "--data-path", a, b], 4)
    assert cfg.data.prefixes == [a, b] and cfg.data.weights is None
    train, _, _ = build_datasets(cfg, 101)
    sizes = [len(d) for d in train.datasets]
    assert sizes[1] > 3 * sizes[0]  # the sizes differ enough that equal weights could not pass
    counts = np.bincount(train.dataset_index, minlength=2)
    assert len(train) == sum(sizes) and counts.tolist() == sizes
    # Fewer samples than the prefixes hold: a prefix of that blend, still in proportion to size.
    cfg = parse_args(base + ["--train-iters", "10", "--data-path", a, b], 4)
    train, _, _ = build_datasets(cfg, 101)
    assert len(train) == 80
    share = np.bincount(train.dataset_index, minlength=2)[0] / 80
    assert abs(share - sizes[0] / sum(sizes)) <= 1 / 80
    # Given weights still rule: 1 A 1 B is an equal blend.
    cfg = parse_args(base + ["--train-iters", "10", "--data-path", "1", a, "1", b], 4)
    train, _, _ = build_datasets(cfg, 101)
    assert cfg.data.weights == [0.5, 0.5] and abs(np.mean(train.dataset_index[:80] == 0) - 0.5) <= 1 / 80
