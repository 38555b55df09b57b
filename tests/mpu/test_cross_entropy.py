"""vocab_parallel_cross_entropy against F.cross_entropy on the gathered logits."""

import pytest
import torch
import torch.nn.functional as F

from megazero import mpu
from tests.distributed import run_distributed
from tests.helpers import assert_close, chunk, randn

S, B, V = 6, 3, 32


def _case(tp, label_smoothing, scale, dtype, explicit_group, inplace=False):
    mpu.initialize_model_parallel(tp)
    rank = mpu.get_tensor_model_parallel_rank()
    group = mpu.get_tensor_model_parallel_group() if explicit_group else None
    logits_full = randn(S, B, V, seed=11, scale=scale).to(dtype)
    target = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(12))
    target[0, :] = torch.tensor([0, V - 1, V // 2])[:B]  # ids on shard borders
    target[1, 0] = -100  # ignored position
    g = randn(S, B, seed=13)

    logits = chunk(logits_full, -1, rank, tp).requires_grad_()
    head = logits * 1  # a non-leaf, as a model's logits are
    before = head.detach().clone()
    loss = mpu.vocab_parallel_cross_entropy(head, target, label_smoothing, group=group, inplace=inplace)
    if inplace and dtype == torch.float32:  # the logits' storage now holds this shard's softmax columns
        probs = torch.softmax(logits_full.float(), dim=-1)
        assert_close(head.detach(), chunk(probs, -1, rank, tp), "softmax in the logits' storage", atol=1e-6)
    else:
        assert torch.equal(head.detach(), before), "the caller's logits must be left alone"
    (loss * g).sum().backward()

    ref_logits = logits_full.detach().float().requires_grad_()
    ref = F.cross_entropy(ref_logits.view(-1, V), target.view(-1), reduction="none",
                          label_smoothing=label_smoothing, ignore_index=-100).view(S, B)
    (ref * g).sum().backward()

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert loss.dtype == torch.float32
    d_loss = assert_close(loss, ref, "loss", atol=tol * max(1.0, scale / 10), rtol=tol)
    assert loss[1, 0] == 0 and torch.all(logits.grad[1, 0] == 0), "ignored position must have no loss and no grad"
    assert logits.grad.dtype == dtype
    d_grad = assert_close(logits.grad.float(), chunk(ref_logits.grad, -1, rank, tp), "logit grads", atol=tol, rtol=tol)
    assert torch.isfinite(loss).all()
    return d_loss, d_grad


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_matches_torch_cross_entropy(tp):
    for label_smoothing in (0.0, 0.1):
        for explicit_group in (False, True):
            run_distributed(4, _case, tp, label_smoothing, 3.0, torch.float32, explicit_group)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_inplace_gives_the_same_loss_and_grads(dtype):
    """``inplace=True`` (what the GPT's head passes) reuses fp32 logits for the softmax and never
    touches half-precision ones; loss and gradients are those of the out-of-place path."""
    for label_smoothing in (0.0, 0.1):
        run_distributed(2, _case, 2, label_smoothing, 3.0, dtype, False, True)


@pytest.mark.parametrize("tp", [2, 4])
def test_large_logits_and_bf16_are_stable(tp):
    run_distributed(4, _case, tp, 0.0, 1e4, torch.float32, False)  # exp() would overflow without the max shift
    run_distributed(4, _case, tp, 0.1, 5.0, torch.bfloat16, False)


def test_label_smoothing_range_is_checked():
    with pytest.raises(ValueError, match="label_smoothing"):
        mpu.vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 1.5)


VALID = 21  # of V=32 padded columns: at tp 4 rank 2 holds 5 real columns and rank 3 none


def _padded_case(tp, label_smoothing, dtype, pad_fill, inplace=False):
    mpu.initialize_model_parallel(tp)
    rank = mpu.get_tensor_model_parallel_rank()
    logits_full = randn(S, B, V, seed=21, scale=3.0)
    # GPTModel writes -inf into the padded columns; arbitrary values there must not matter either.
    logits_full[..., VALID:] = pad_fill
    logits_full = logits_full.to(dtype)
    target = torch.randint(0, VALID, (S, B), generator=torch.Generator().manual_seed(22))
    target[0, :] = torch.tensor([0, VALID - 1, 16])[:B]  # the last real id; the first id of rank 2 at tp 4
    target[1, 1] = -100
    g = randn(S, B, seed=23)

    logits = chunk(logits_full, -1, rank, tp).requires_grad_()
    head = logits * 1 if inplace else logits
    loss = mpu.vocab_parallel_cross_entropy(head, target, label_smoothing, vocab_size=VALID, inplace=inplace)
    if not inplace:
        assert torch.equal(logits.detach(), chunk(logits_full, -1, rank, tp)), "the caller's logits must not change"
    (loss * g).sum().backward()

    ref_logits = logits_full[..., :VALID].detach().float().requires_grad_()
    ref = F.cross_entropy(ref_logits.reshape(-1, VALID), target.view(-1), reduction="none",
                          label_smoothing=label_smoothing).view(S, B)
    (ref * g).sum().backward()

    assert torch.isfinite(loss).all() and torch.isfinite(logits.grad.float()).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    d_loss = assert_close(loss, ref, "loss", atol=tol, rtol=tol)
    ref_grad = F.pad(ref_logits.grad, (0, V - VALID))  # padded columns: gradient exactly 0
    d_grad = assert_close(logits.grad.float(), chunk(ref_grad, -1, rank, tp), "logit grads", atol=tol, rtol=tol)
    pad_grad = chunk(torch.arange(V) >= VALID, -1, rank, tp)
    assert torch.all(logits.grad[..., pad_grad] == 0)
    return d_loss, d_grad


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_label_smoothing_ignores_padded_vocabulary(tp):
    for pad_fill in (float("-inf"), 7.0):
        for a in (0.0, 0.1):
            run_distributed(4, _padded_case, tp, a, torch.float32, pad_fill)
    run_distributed(4, _padded_case, tp, 0.1, torch.float32, 7.0, True)  # as the GPT's head calls it
    run_distributed(4, _padded_case, tp, 0.1, torch.bfloat16, float("-inf"))


def test_padded_logits_without_vocab_size_give_inf_smoothed_loss():
    # The failure vocab_size exists for: the smoothing mean over all columns includes -inf.
    logits = torch.randn(2, 8)
    logits[:, 6:] = float("-inf")
    target = torch.tensor([1, 5])
    assert torch.isinf(mpu.vocab_parallel_cross_entropy(logits, target, 0.1)).all()
    assert torch.isfinite(mpu.vocab_parallel_cross_entropy(logits, target, 0.1, vocab_size=6)).all()


def test_vocab_size_range_is_checked():
    with pytest.raises(ValueError, match=r"vocab_size \(9\) must be in \[1, 8\]"):
        mpu.vocab_parallel_cross_entropy(torch.zeros(2, 8), torch.zeros(2, dtype=torch.long), vocab_size=9)
