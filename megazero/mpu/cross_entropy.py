"""Cross-entropy over vocabulary-sharded logits, without gathering the vocabulary.

For logits ``z`` split across TP ranks along the vocabulary, per token::

    loss = log(sum_j exp(z_j - m)) - (z_t - m),   m = max_j z_j

Each rank computes its partial max, partial sum of exponentials and (if it owns
the target) the target logit; two all-reduces (one MAX, one SUM of a stacked
tensor) make them global. Math runs in fp32 whatever the input dtype, so bf16
logits and very large logits stay stable. The gradient ``softmax - onehot`` is
formed locally in backward with no further communication.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .mappings import _rank, _size, resolve_tp_group
from .utils import VocabUtility

__all__ = ["vocab_parallel_cross_entropy"]


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, label_smoothing, ignore_index, group):
        world, rank = _size(group), _rank(group)
        z = logits.float()
        local_vocab = z.size(-1)
        vocab = local_vocab * world
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(local_vocab, rank, world)

        m = z.max(dim=-1, keepdim=True)[0]
        if world > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)
        z = z - m

        ignored = target == ignore_index
        outside = (target < start) | (target >= end) | ignored
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)
        exp_z = z.exp()
        stats = torch.stack([target_logit, exp_z.sum(dim=-1), z.sum(dim=-1)], dim=0)
        if world > 1:
            dist.all_reduce(stats, group=group)
        target_logit, sum_exp, sum_z = stats.unbind(0)

        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0.0:
            # torch's definition: (1 - a) * nll + a * mean_j(-log p_j)
            mean_log_prob = sum_z / vocab - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob
        loss = loss.masked_fill(ignored, 0.0)

        softmax = exp_z.div_(sum_exp.unsqueeze(-1))
        ctx.label_smoothing, ctx.vocab, ctx.input_dtype = label_smoothing, vocab, logits.dtype
        ctx.save_for_backward(softmax, local_target, outside, ignored)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, outside, ignored = ctx.saved_tensors
        a = ctx.label_smoothing
        grad = softmax
        hit = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(1.0 - a) * hit.unsqueeze(-1))
        if a > 0.0:
            grad.sub_(a / ctx.vocab)
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    ignore_index: int = -100,
    group: Optional[dist.ProcessGroup] = None,
) -> torch.Tensor:
    """Per-token loss ``[...]`` (fp32) from logits ``[..., vocab / tp]`` and global ``target`` ids.

    Positions whose target equals ``ignore_index`` get loss 0 and no gradient,
    as ``F.cross_entropy(..., reduction="none")`` does.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, ignore_index, resolve_tp_group(group))
