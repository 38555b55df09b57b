"""generate() appends the same tokens on every rank, and stops at the same step, even when the
data-parallel replicas' logits differ in the last bit (as two replicas' TP all-reduces can on GPUs).

The model is a stand-in that returns fixed vocab-parallel logits with a tie; the last
data-parallel replica's logits are one ulp apart, enough to break the tie the other way.
"""

import contextlib
from unittest import mock

import pytest
import torch

from megazero import mpu
from megazero.model import sampling
from tests.distributed import run_distributed

VOCAB, EOD = 8, 7


class _TieModel(torch.nn.Module):
    """``[b, t, VOCAB / tp]``: this TP rank's shard of ``logits`` at every position, with ``bumped``
    raised by one ulp on the last data-parallel replica. Counts its forward passes."""

    def __init__(self, logits: torch.Tensor, bumped: int) -> None:
        super().__init__()
        full = logits.clone()
        if mpu.get_data_parallel_rank() == mpu.get_data_parallel_world_size() - 1:
            full[bumped] = torch.nextafter(full[bumped], torch.tensor(float("inf")))
        tp, r = mpu.get_tensor_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()
        self.shard = full.chunk(tp)[r]
        self.forwards = 0

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.forwards += 1
        return self.shard.expand(tokens.size(0), tokens.size(1), -1).clone()


def _generate(logits: torch.Tensor, bumped: int, shared: bool, **kwargs) -> tuple[list, int]:
    """The new tokens and the number of forward passes; ``shared=False`` samples each rank's own logits."""
    model = _TieModel(logits, bumped)
    prompt = torch.zeros(kwargs.pop("batch", 1), 2, dtype=torch.long)
    unshared = mock.patch.object(sampling, "agree_on_tokens", lambda t, group=None: t)
    with contextlib.nullcontext() if shared else unshared:
        out = sampling.generate(model, prompt, kwargs.pop("max_new_tokens"), seq_length=16, vocab_size=VOCAB, **kwargs)
    return out[:, 2:].tolist(), model.forwards


def _both_ways(tp: int, logits: torch.Tensor, bumped: int, **kwargs) -> dict:
    mpu.initialize_model_parallel(tp)
    return {"shared": _generate(logits, bumped, True, **dict(kwargs)),
            "local": _generate(logits, bumped, False, **dict(kwargs))}


def _check(outs: list[dict]) -> None:
    shared, local = [o["shared"] for o in outs], [o["local"] for o in outs]
    # Sampling each rank's own logits diverges: the test would catch the unshared loop.
    assert local[0] != local[-1]
    # Shared: every rank returns the tokens rank 0 samples from its own logits, after as many forwards.
    assert all(s == local[0] for s in shared), shared


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2xdp2", "tp1xdp4"])
def test_greedy_near_tie_same_tokens_and_same_stop(tp):
    # Tokens 5 and EOD tie; one ulp more for EOD on the last replica makes it stop after one step.
    logits = torch.full((VOCAB,), -10.0)
    logits[5] = logits[EOD] = 1.0
    outs = run_distributed(4, _both_ways, tp, logits, EOD, max_new_tokens=4, temperature=0.0, eod=EOD)
    assert outs[0]["local"] == ([[5, 5, 5, 5]], 4) and outs[-1]["local"] == ([[EOD]], 1)
    _check(outs)


@pytest.mark.parametrize("tp", [2, 1], ids=["tp2xdp2", "tp1xdp4"])
def test_top_k_near_tie_same_samples(tp):
    # With top_k=1, tokens 1 and 2 tie for the top and both are kept; one ulp more for token 1
    # on the last replica keeps token 1 alone, so that replica never samples token 2.
    logits = torch.full((VOCAB,), -30.0)
    logits[1] = logits[2] = 0.5
    outs = run_distributed(4, _both_ways, tp, logits, 1, max_new_tokens=12, temperature=1.0, top_k=1,
                           seed=3, batch=2, eod=EOD)
    assert outs[-1]["local"] == ([[1] * 12] * 2, 12)
    assert any(2 in row for row in outs[0]["local"][0])
    _check(outs)


def test_single_process_needs_no_group():
    tokens = torch.tensor([3, 4])
    assert sampling.agree_on_tokens(tokens) is tokens
