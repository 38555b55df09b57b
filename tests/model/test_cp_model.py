"""A GPT run context-parallel (each rank a balanced share of every sequence's tokens) against the
same GPT in one process: per-token losses and parameter gradients (summed over the CP ranks)."""

import pytest
import torch
import torch.distributed as dist

from megazero.model import GPTConfig, GPTModel
from megazero.model.attention.cp.exchanges import SequenceShard
from megazero.model.attention.cp.context import ContextParallel
from megazero.model.attention.cp.layout import document_layout, zigzag_layout
from tests.distributed import run_distributed

S, B, V = 32, 2, 96


def _config(position: str) -> GPTConfig:
    return GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=V,
                     seq_length=S, max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0,
                     position_embedding_type=position, make_vocab_size_divisible_by=32, attention_backend="sdpa")


def _zigzag(rank: int, cp: int) -> torch.Tensor:
    """Positions of rank ``rank``: chunks ``rank`` and ``2cp - 1 - rank`` of 2cp (the balanced causal split)."""
    c = S // (2 * cp)
    return torch.cat([torch.arange(rank * c, (rank + 1) * c), torch.arange((2 * cp - 1 - rank) * c, (2 * cp - rank) * c)])


def _data():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (B, S + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


DOCS = [8, 16, 8]  # packed document lengths: multiples of 2 x cp for the ring's per-document split


def _documents() -> torch.Tensor:
    """The packed documents as a block-diagonal mask (True = masked), in global order."""
    doc = torch.repeat_interleave(torch.arange(len(DOCS)), torch.tensor(DOCS))
    return doc[:, None] != doc[None, :]


def _one_process(position: str, documents: bool):
    torch.manual_seed(0)
    model = GPTModel(_config(position))
    ids, labels = _data()
    mask = _documents() if documents else None
    loss = model(ids, torch.arange(S), attention_mask=mask, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _context_parallel(position: str, comm_type: str, documents: bool):
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPTModel(_config(position))
    ids, labels = _data()
    mask = _documents() if documents else None
    if comm_type == "p2p":  # the ring splits each document itself and takes no mask
        cu = [0] + torch.tensor(DOCS).cumsum(0).tolist()
        layout = document_layout(cu, cp) if documents else zigzag_layout(S, cp)
        ctx, mask = ContextParallel.from_layout(layout, rank, None, "p2p"), None
        pos = layout.positions(rank)
    else:
        pos = _zigzag(rank, cp)
        shard = SequenceShard.from_rank_positions([_zigzag(r, cp) for r in range(cp)], rank)
        ctx = ContextParallel(group=None, comm_type=comm_type, shard=shard)
    loss = model(ids[:, pos], pos, attention_mask=mask, labels=labels[:, pos], context_parallel=ctx)
    loss.sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)  # what ZeRO's reduction over data x context parallel does
        grads[n] = p.grad
    return pos, loss.detach(), grads


@pytest.mark.parametrize("comm_type", ["p2p", "a2a", "allgather"])
@pytest.mark.parametrize("cp,position,documents", [(2, "rope", False), (2, "learned", True), (4, "rope", True)])
def test_a_context_parallel_gpt_equals_one_process(cp, position, documents, comm_type):
    ref_loss, ref_grads = _one_process(position, documents)
    for pos, loss, grads in run_distributed(cp, _context_parallel, position, comm_type, documents):
        torch.testing.assert_close(loss, ref_loss[:, pos], rtol=1e-5, atol=1e-6)
        for n, g in grads.items():
            torch.testing.assert_close(g, ref_grads[n], rtol=2e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_a_context_parallel_forward_without_positions_is_refused():
    model = GPTModel(_config("rope"))
    shard = SequenceShard.from_rank_positions([torch.arange(S)], 0)
    with pytest.raises(ValueError, match="position_ids"):
        model(torch.zeros(1, S, dtype=torch.long), context_parallel=ContextParallel(None, "a2a", shard))
