"""Deterministic tensors and shard helpers shared by the tests."""

from __future__ import annotations

import torch

# The NullTokenizer vocabulary of the shared training corpus (tests/conftest.py): ids < 120, EOD = 120.
VOCAB = 120


def randn(*shape: int, seed: int, scale: float = 1.0, dtype=torch.float32) -> torch.Tensor:
    """The same tensor on every rank (own generator, independent of the global RNG)."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def chunk(t: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    return t.chunk(world, dim=dim)[rank].contiguous()


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str, atol: float = 1e-5, rtol: float = 1e-5) -> float:
    """assert_close that names the quantity and returns the max abs difference."""
    torch.testing.assert_close(actual, expected, atol=atol, rtol=rtol, msg=lambda m: f"{what}: {m}")
    return float((actual.detach().float() - expected.detach().float()).abs().max()) if actual.numel() else 0.0


def write_documents(prefix: str, docs) -> str:
    """Write ``docs`` (token-id sequences, EOD included where wanted) as a Megatron ``.bin/.idx`` pair."""
    import numpy as np

    from megazero.data import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.uint16)
    for doc in docs:
        builder.add_item(np.asarray(doc))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix


def write_progressions(prefix: str, num_docs: int, lengths: tuple[int, int], seed: int) -> str:
    """``num_docs`` learnable documents, arithmetic progressions mod :data:`VOCAB` of ``lengths[0]``
    to ``lengths[1] - 1`` tokens, each ended by EOD (= VOCAB), as a ``.bin/.idx`` pair; returns ``prefix``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    docs = []
    for _ in range(num_docs):
        start, step, n = rng.integers(0, VOCAB), rng.integers(1, 4), rng.integers(*lengths)
        docs.append(np.append((start + step * np.arange(n)) % VOCAB, VOCAB))
    return write_documents(prefix, docs)
