"""Gated DeltaNet layers run context-parallel (each rank two zigzag chunks of every sequence; the ranks all-gather
each run's state summary and the convolution's halo; or Megatron's heads all-to-all) against the same GPT in one process: per-token losses and
parameter gradients (summed over the CP ranks), with and without packed documents, whose ends fall inside
chunks and on the shards' cuts."""

import pytest
import torch
import torch.distributed as dist

from megazero.model import GPTConfig, GPTModel
from megazero.model.attention.cp.input import context_parallel_context, prepare_context_parallel_input
from tests.distributed import run_distributed

S, B, V = 32, 2, 96
CU = [0, 5, 8, 21, 32]  # document ends inside chunks (5, 21) and on a cut (8 at cp 2 and 4)


def _config(linear_cp: str = "state_passing") -> GPTConfig:
    return GPTConfig(linear_cp_comm_type=linear_cp, num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=V,
                     seq_length=S, max_position_embeddings=S, hidden_dropout=0.0, attention_dropout=0.0,
                     position_embedding_type="rope", make_vocab_size_divisible_by=32, attention_backend="sdpa",
                     experimental_attention_variant="gated_delta_net", linear_attention_freq=2,
                     linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8)


def _data():
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (B, S + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def _mask() -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(len(CU) - 1), torch.tensor(CU).diff())
    return (doc[:, None] != doc[None, :]) | torch.ones(S, S, dtype=torch.bool).triu(1)


def _one_process(documents: bool):
    torch.manual_seed(0)
    model = GPTModel(_config())
    ids, labels = _data()
    loss = model(ids, torch.arange(S), attention_mask=_mask() if documents else None, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


class _Groups:
    def __init__(self, cp: int, rank: int) -> None:
        self.cp_size, self.cp_rank, self.cp_group = cp, rank, None


def _context_parallel(comm_type: str, documents: bool, linear_cp: str):
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPTModel(_config(linear_cp))
    ids, labels = _data()
    ctx = context_parallel_context(S, _Groups(cp, rank), comm_type, torch.device("cpu"))
    ctx, local, pos, mask = prepare_context_parallel_input(
        ctx, {"ids": ids, "labels": labels}, None, _mask() if documents else None,
        [CU] * B if documents else None, balance_documents=False)
    loss = model(local["ids"], pos, attention_mask=mask, labels=local["labels"], context_parallel=ctx)
    loss.sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[n] = p.grad
    return pos, loss.detach(), grads


@pytest.mark.parametrize("cp,comm_type,documents,linear_cp", [
    (2, "p2p", False, "state_passing"), (2, "a2a", True, "state_passing"), (4, "p2p", True, "state_passing"),
    (4, "allgather", False, "state_passing"),
    (2, "p2p", True, "a2a"),  # Megatron's: the whole sequence for half the heads on each rank
])
def test_gated_delta_net_context_parallel_equals_one_process(cp, comm_type, documents, linear_cp):
    ref_loss, ref_grads = _one_process(documents)
    for pos, loss, grads in run_distributed(cp, _context_parallel, comm_type, documents, linear_cp):
        torch.testing.assert_close(loss, ref_loss[:, pos], rtol=1e-5, atol=1e-6)
        for n, g in grads.items():
            assert (g - ref_grads[n]).abs().max() <= 2e-6 + 1e-5 * ref_grads[n].abs().max(), (n, (g - ref_grads[n]).abs().max(), ref_grads[n].abs().max())


def test_documents_change_the_run():
    """The resets are applied: the losses with documents differ from those without."""
    with_docs, _ = _one_process(True)
    without, _ = _one_process(False)
    assert not torch.allclose(with_docs[:, 8:], without[:, 8:])
