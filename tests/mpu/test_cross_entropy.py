"""vocab_parallel_cross_entropy against F.cross_entropy on the gathered logits."""

import pytest
import torch
import torch.nn.functional as F

from megazero import mpu
from tests.distributed import run_distributed
from tests.helpers import assert_close, chunk, randn

S, B, V = 6, 3, 32


def _case(tp, label_smoothing, scale, dtype, explicit_group):
    mpu.initialize_model_parallel(tp)
    rank = mpu.get_tensor_model_parallel_rank()
    group = mpu.get_tensor_model_parallel_group() if explicit_group else None
    logits_full = randn(S, B, V, seed=11, scale=scale).to(dtype)
    target = torch.randint(0, V, (S, B), generator=torch.Generator().manual_seed(12))
    target[0, :] = torch.tensor([0, V - 1, V // 2])[:B]  # ids on shard borders
    target[1, 0] = -100  # ignored position
    g = randn(S, B, seed=13)

    logits = chunk(logits_full, -1, rank, tp).requires_grad_()
    loss = mpu.vocab_parallel_cross_entropy(logits, target, label_smoothing, group=group)
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


@pytest.mark.parametrize("tp", [2, 4])
def test_large_logits_and_bf16_are_stable(tp):
    run_distributed(4, _case, tp, 0.0, 1e4, torch.float32, False)  # exp() would overflow without the max shift
    run_distributed(4, _case, tp, 0.1, 5.0, torch.bfloat16, False)


def test_label_smoothing_range_is_checked():
    with pytest.raises(ValueError, match="label_smoothing"):
        mpu.vocab_parallel_cross_entropy(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long), 1.5)
