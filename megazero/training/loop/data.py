"""The run's data: its three splits (or synthetic samples), each rank's loader over them, agreed reads."""

from __future__ import annotations

from typing import Iterator, Optional

import torch

from megazero.config.train_config import TrainConfig
from megazero.utils.phase_agreement import agree

__all__ = ["MockGPTDataset", "build_datasets", "loader", "take", "read_agreed"]


class MockGPTDataset(torch.utils.data.Dataset):
    """Synthetic ``seq_length + 1`` token samples, a pure function of (seed, index) (``--mock-data``)."""

    def __init__(self, num_samples: int, seq_length: int, vocab_size: int, seed: int) -> None:
        self.num_samples, self.seq_length, self.vocab_size, self.seed = num_samples, seq_length, vocab_size, seed

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        return {"text": torch.randint(0, self.vocab_size, (self.seq_length + 1,), generator=g).numpy()}


def build_datasets(config: TrainConfig, tokenizer_vocab: Optional[int]):
    """``(train, valid, test)`` of the run (a split may be None); collective-free, so callers agree on it."""
    s = config.schedule
    # Every evaluation reads the same first eval_iters global batches of the validation (or test) split.
    eval_samples = s.eval_iters * s.global_batch_size
    num_samples = (s.train_samples, eval_samples, eval_samples)
    if config.data.mock_data:
        vocab = tokenizer_vocab or config.model.vocab_size
        return (MockGPTDataset(num_samples[0], config.model.seq_length, vocab, config.seed),
                MockGPTDataset(max(num_samples[1], 1), config.model.seq_length, vocab, config.seed + 1),
                MockGPTDataset(max(num_samples[2], 1), config.model.seq_length, vocab, config.seed + 2))
    from megazero.data import build_train_valid_test_datasets

    d = config.data
    # vocab_size: a token id outside the tokenizer's vocabulary is an error naming the dataset and
    # document when it is read (the embedding would otherwise take it silently at tp > 1).
    common = dict(cache_dir=d.data_cache_path, vocab_size=tokenizer_vocab)
    if d.train_data_path:
        # Megatron's separate split files: each path list is a whole split of its own.
        return build_train_valid_test_datasets(
            None, d.split, config.model.seq_length, config.seed, num_samples,
            train_data_path=d.train_data_path, valid_data_path=d.valid_data_path or None,
            test_data_path=d.test_data_path or None, **common)
    # Unweighted 'A B' passes through as is: megatron-core blends such prefixes by their sizes.
    return build_train_valid_test_datasets(d.data_path, d.split, config.model.seq_length,
                                           config.seed, num_samples, **common)


def loader(dataset, consumed: int, config: TrainConfig, groups, device: torch.device) -> Optional[Iterator]:
    """This data-parallel rank's micro-batches of ``dataset`` from sample ``consumed`` on (None without data)."""
    from megazero.data import build_pretraining_data_loader

    batches = build_pretraining_data_loader(dataset, consumed, config.schedule.micro_batch_size,
                                            groups.dp_rank, groups.dp_size,
                                            num_workers=config.data.num_workers, device=device)
    return iter(batches) if batches is not None else None


def take(it: Iterator, n: int, partial: bool = False) -> Optional[list[dict]]:
    """``n`` loader batches; when the loader runs out (on every rank alike): what was read
    (``partial``) or None."""
    out = []
    for _ in range(n):
        b = next(it, None)
        if b is None:
            return out if partial and out else None
        out.append(b)
    return out


def read_agreed(it: Iterator, n: int, phase: str, partial: bool = False) -> Optional[list[dict]]:
    """``n`` loader batches, agreed: a bad sample (a token outside the vocabulary) raises on the
    ranks that read it only, and must stop every rank."""
    return agree(phase, lambda: take(it, n, partial), user_errors=(ValueError,))
