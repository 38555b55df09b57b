"""Cross-entropy over vocabulary-sharded logits, without gathering the vocabulary.

For logits ``z`` split across TP ranks along the vocabulary, per token::

    loss = log(sum_j exp(z_j - m)) - (z_t - m),   m = max_j z_j

Each rank computes its partial max, partial sum of exponentials and (if it owns
the target) the target logit; two all-reduces (one MAX, one SUM of a stacked
tensor) make them global. Math runs in fp32 whatever the input dtype, so bf16
logits and very large logits stay stable. The gradient ``softmax - onehot`` is
formed locally in backward with no further communication.

Padded vocabulary: with ``vocab_size`` (the unpadded size) the columns at global
ids ``>= vocab_size`` do not exist for the loss: they are left out of the softmax,
of label smoothing's mean over the vocabulary and of the gradient (0 there), so the
result equals ``F.cross_entropy(logits[..., :vocab_size], ...)``. Without it a
model that masks padded logits to -inf would get an infinite smoothed loss
(the mean of the log-probabilities includes -inf).
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
    def forward(ctx, logits, target, label_smoothing, ignore_index, group, vocab_size, inplace):
        world, rank = _size(group), _rank(group)
        z = logits.float()  # a copy for half/bf16 logits (ours to overwrite); fp32 logits are the caller's
        local_vocab = z.size(-1)
        padded_vocab = local_vocab * world
        vocab = padded_vocab if vocab_size is None else vocab_size
        if not 1 <= vocab <= padded_vocab:
            raise ValueError(f"vocab_size ({vocab_size}) must be in [1, {padded_vocab}] (the padded vocabulary: "
                             f"{local_vocab} logits per rank x {world} tensor parallel ranks)")
        start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(local_vocab, rank, world)
        # Columns [valid, local_vocab) of this shard are padding (may be all of them on the last ranks).
        valid = min(max(vocab - start, 0), local_vocab)
        if valid > 0:
            # amax: the values only (max(dim) also finds the indices: 4.5x slower on a CPU at
            # 1024 x 4096, and a second output on a GPU). Both propagate a nan.
            m = z[..., :valid].amax(dim=-1, keepdim=True)
        else:
            m = z.new_full(z.shape[:-1] + (1,), float("-inf"))
        if world > 1:
            dist.all_reduce(m, op=dist.ReduceOp.MAX, group=group)

        ignored = target == ignore_index
        outside = (target < start) | (target >= end) | ignored
        local_target = (target - start).masked_fill(outside, 0)
        target_logit = (z.gather(-1, local_target.unsqueeze(-1)) - m).squeeze(-1).masked_fill(outside, 0.0)

        # One buffer of logits' size carries z - m, then exp(z - m), then the softmax saved for backward:
        # every pass after the max is in place (a fresh buffer per pass costs its page faults on a CPU
        # and its size at the step's peak anywhere). It is the logits' own storage when ours to reuse.
        e = z.sub_(m) if (inplace or z is not logits) else z - m
        if valid < local_vocab:
            e[..., valid:] = float("-inf")
        # The smoothing mean needs sum_j (z_j - m) over the real columns: taken before exp_ overwrites e.
        sum_z = [e[..., :valid].sum(dim=-1)] if label_smoothing > 0.0 else []
        stats = torch.stack([target_logit, e.exp_().sum(dim=-1), *sum_z], dim=0)
        if world > 1:
            dist.all_reduce(stats, group=group)
        target_logit, sum_exp = stats[0], stats[1]

        log_sum_exp = sum_exp.log()
        loss = log_sum_exp - target_logit
        if label_smoothing > 0.0:
            # torch's definition: (1 - a) * nll + a * mean_j(-log p_j)
            mean_log_prob = stats[2] / vocab - log_sum_exp
            loss = (1.0 - label_smoothing) * loss - label_smoothing * mean_log_prob
        loss = loss.masked_fill(ignored, 0.0)

        softmax = e.div_(sum_exp.unsqueeze(-1))
        ctx.label_smoothing, ctx.vocab, ctx.valid, ctx.input_dtype = label_smoothing, vocab, valid, logits.dtype
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
            # Padded columns are outside the smoothing mean: their softmax is 0, and so stays their gradient.
            grad[..., :ctx.valid].sub_(a / ctx.vocab)
        grad.mul_((grad_loss * (~ignored).to(grad.dtype)).unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None, None, None, None


def vocab_parallel_cross_entropy(
    vocab_parallel_logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    *,
    ignore_index: int = -100,
    group: Optional[dist.ProcessGroup] = None,
    vocab_size: Optional[int] = None,
    inplace: bool = False,
) -> torch.Tensor:
    """Per-token loss ``[...]`` (fp32) from logits ``[..., vocab / tp]`` and global ``target`` ids.

    Positions whose target equals ``ignore_index`` get loss 0 and no gradient,
    as ``F.cross_entropy(..., reduction="none")`` does.

    ``vocab_size``: the number of real vocabulary entries when the logits are padded
    (Megatron's ``padded_vocab_size``); ids ``>= vocab_size`` are then ignored by the
    softmax, the label-smoothing mean and the gradient. ``None``: every column is real.
    A target id in the padded range has probability 0 and an infinite loss.

    ``inplace``: fp32 logits are overwritten with the softmax that backward needs, as
    Megatron-core's cross-entropy does, where otherwise a buffer of their size is allocated
    beside them; for a caller whose logits are a temporary (the GPT's head), that is one
    ``[tokens, vocab/tp]`` fp32 buffer less at the step's peak. The caller's tensor then holds
    the softmax, not the logits. Half and bf16 logits are converted into a copy either way, and
    never changed.
    """
    if not 0.0 <= label_smoothing < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing}")
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, label_smoothing, ignore_index,
                                            resolve_tp_group(group), vocab_size, inplace)
