"""Data-parallel batch sampling that resumes exactly from a sample count.

Samples are consumed in order ``consumed_samples, consumed_samples + 1, ...``; the
dataset is already shuffled. Each global chunk of ``micro_batch_size * dp_size``
samples is cut into ``dp_size`` contiguous slices, slice ``r`` going to data-parallel
rank ``r``. Tensor/pipeline-parallel ranks of one DP rank pass the same rank and get
identical batches. Because the position is just ``consumed_samples``, a restarted
run continues the exact same stream.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from .batch import pin_memory_for


class MegatronPretrainingSampler:
    """Yields this DP rank's micro-batches (lists of dataset indices).

    ``drop_last=False`` also yields this rank's slice of a final incomplete chunk,
    which may be shorter than ``micro_batch_size`` or empty.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ):
        if total_samples <= 0:
            raise ValueError(f"total_samples must be positive, got {total_samples}")
        if not 0 <= consumed_samples <= total_samples:
            raise ValueError(f"consumed_samples {consumed_samples} outside [0, {total_samples}]: "
                             f"the checkpoint consumed more samples than the dataset holds")
        if micro_batch_size <= 0:
            raise ValueError(f"micro_batch_size must be positive, got {micro_batch_size}")
        if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
            raise ValueError(f"data_parallel_rank {data_parallel_rank} not in [0, {data_parallel_size})")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last
        self._global = micro_batch_size * data_parallel_size

    def __len__(self) -> int:
        """Micro-batches this rank will yield."""
        remaining = self.total_samples - self.consumed_samples
        full, rest = divmod(remaining, self._global)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        start = self.data_parallel_rank * self.micro_batch_size
        chunk = self.consumed_samples
        while chunk + self._global <= self.total_samples:
            first = chunk + start
            yield list(range(first, first + self.micro_batch_size))
            chunk += self._global
        if chunk < self.total_samples and not self.drop_last:
            first = min(chunk + start, self.total_samples)
            yield list(range(first, min(first + self.micro_batch_size, self.total_samples)))


class _WithIndex(torch.utils.data.Dataset):
    """``dataset``'s samples with their index in it, which keys position-keyed dropout per sample."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> dict:
        return {**self.dataset[i], "index": i}


def collate_text(samples: list[dict]) -> dict[str, torch.Tensor]:
    """``[{"text": int array [seq+1], "index": int (optional)}, ...]`` -> ``{"text": LongTensor [b, seq+1]}``
    and, when the samples carry it, ``"index"``: LongTensor [b], their indices in the dataset."""
    if not samples:
        return {"text": torch.empty(0, 0, dtype=torch.long)}
    out = {"text": torch.from_numpy(np.stack([np.asarray(s["text"], dtype=np.int64) for s in samples]))}
    if "index" in samples[0]:
        out["index"] = torch.tensor([s["index"] for s in samples], dtype=torch.long)
    return out


def build_pretraining_data_loader(
    dataset,
    consumed_samples: int,
    micro_batch_size: int,
    data_parallel_rank: int,
    data_parallel_size: int,
    num_workers: int = 0,
    *,
    drop_last: bool = True,
    device=None,
) -> torch.utils.data.DataLoader | None:
    """DataLoader over ``dataset`` yielding ``{"text": LongTensor [micro_batch, seq+1], "index":
    LongTensor [micro_batch]}`` (the samples' indices in ``dataset``) for this DP rank, starting after
    ``consumed_samples``. None for a None dataset.

    ``device`` is where the batches go (with :func:`megazero.data.batch.to_device`): the
    batches are pinned for a CUDA device only. Without it, they are pinned when CUDA exists.
    """
    if dataset is None:
        return None
    sampler = MegatronPretrainingSampler(
        total_samples=len(dataset), consumed_samples=consumed_samples,
        micro_batch_size=micro_batch_size, data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size, drop_last=drop_last,
    )
    # A private generator: creating the iterator draws a seed from it, and drawing from the
    # global one would shift dropout masks after a checkpoint restores the RNG (inexact resume).
    return torch.utils.data.DataLoader(
        _WithIndex(dataset), batch_sampler=sampler, num_workers=num_workers, collate_fn=collate_text,
        generator=torch.Generator().manual_seed(0),
        pin_memory=torch.cuda.is_available() if device is None else pin_memory_for(device),
        persistent_workers=num_workers > 0,
    )
