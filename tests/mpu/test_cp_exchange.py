"""The context-parallel collectives, forward and backward, with values worked out by hand."""

import pytest
import torch

from megazero.mpu.cp_exchange import (CommCounter, gather_sequence, heads_to_seq_all_to_all,
                                      replicated_kv_all_to_all, seq_to_heads_all_to_all)
from tests.distributed import run_distributed


def _tagged(rank: int, s: int, n: int) -> torch.Tensor:
    """``[s, 1, n, 1]`` with value 1000 * rank + 10 * token + head: every element names its origin."""
    token = torch.arange(s, dtype=torch.float32).view(s, 1, 1, 1)
    head = torch.arange(n, dtype=torch.float32).view(1, 1, n, 1)
    return 1000.0 * rank + 10.0 * token + head


def _exchanges(cp):
    rank = torch.distributed.get_rank()
    s, n, per = 3, 2 * cp, 2
    counter = CommCounter()

    x = _tagged(rank, s, n).requires_grad_()
    y = seq_to_heads_all_to_all(x, None, counter)
    # row j*s + t holds token t of rank j; head h is global head rank*per + h
    want = torch.cat([_tagged(j, s, n)[:, :, rank * per:(rank + 1) * per] for j in range(cp)])
    assert torch.equal(y, want)
    back = heads_to_seq_all_to_all(y, None, counter)
    assert torch.equal(back, x.detach())
    gy = torch.full_like(back, float(rank + 1))
    back.backward(gy)
    assert torch.equal(x.grad, gy)  # the round trip is the identity both ways
    elements = s * n * (cp - 1) // cp
    assert counter.elements_sent == {"forward": 2 * elements, "backward": 2 * elements}
    assert counter.bytes_received == {"forward": 8 * elements, "backward": 8 * elements}

    counter.reset()
    z = _tagged(rank, s, 2).requires_grad_()
    g = gather_sequence(z, None, counter)
    assert torch.equal(g, torch.cat([_tagged(j, s, 2) for j in range(cp)]))
    g.backward(torch.full_like(g, float(rank + 1)))
    assert torch.equal(z.grad, torch.full_like(z, cp * (cp + 1) / 2))  # summed over ranks, own rows kept
    assert counter.elements_received == {"forward": 2 * s * (cp - 1), "backward": 2 * s * (cp - 1)}

    # KV replicated: one KV head for all heads, repeated to n query heads before the exchange
    counter.reset()
    kv = _tagged(rank, s, 1).requires_grad_()
    rep = kv.repeat_interleave(n, dim=2)
    out = replicated_kv_all_to_all(rep, None, counter)
    assert out.shape == (cp * s, 1, per, 1)
    assert torch.equal(out, torch.cat([_tagged(j, s, 1) for j in range(cp)]).expand(-1, -1, per, -1))
    out.backward(torch.ones_like(out) * (rank + 1))
    assert torch.equal(kv.grad, torch.full_like(kv, per * cp * (cp + 1) / 2))
    assert counter.elements_sent == {"forward": s * (cp - 1), "backward": s * n * (cp - 1) // cp}

    with pytest.raises(ValueError, match=f"heads / context parallel size: {cp + 1} is not divisible by {cp}"):
        seq_to_heads_all_to_all(torch.zeros(2, 1, cp + 1, 1), None)
    return True


@pytest.mark.parametrize("cp", [2, 4])
def test_exchanges_move_what_the_hand_values_say(cp):
    assert run_distributed(cp, _exchanges, cp) == [True] * cp


def test_one_process_exchanges_nothing():
    x = torch.zeros(2, 1, 3, 1)
    assert seq_to_heads_all_to_all(x, None) is x and gather_sequence(x, None) is x
