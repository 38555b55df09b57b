"""Model-parallel RNG: dropout masks differ across TP ranks, agree across DP ranks, and
activation recomputation reproduces them exactly."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu
from tests.distributed import run_distributed


def _gather(t):
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, t)
    return parts


def _masks():
    groups = mpu.initialize_model_parallel(2)
    mpu.model_parallel_manual_seed(123)
    ones = torch.ones(4096)
    with mpu.get_rng_tracker().fork():
        tp_mask = F.dropout(ones, 0.5)
    default_mask = F.dropout(ones, 0.5)
    return groups.tp_rank, groups.dp_rank, _gather(tp_mask), _gather(default_mask)


def test_dropout_masks_differ_across_tp_and_match_across_dp():
    results = run_distributed(4, _masks)
    _, _, tp_masks, default_masks = results[0]
    layout = [(r[0], r[1]) for r in results]  # (tp_rank, dp_rank) of every global rank
    for a in range(4):
        for b in range(4):
            same_tp = layout[a][0] == layout[b][0]
            assert torch.equal(tp_masks[a], tp_masks[b]) == same_tp, (a, b)
            assert torch.equal(default_masks[a], default_masks[b])  # replicated regions agree everywhere


def _block(x, w):
    # dropout in both streams, so recompute must restore both
    h = F.dropout(x @ w, 0.3)
    with mpu.get_rng_tracker().fork():
        h = F.dropout(torch.tanh(h), 0.3)
    return h


def test_checkpoint_recompute_restores_both_rng_streams():
    w0 = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    x0 = torch.randn(5, 8, generator=torch.Generator().manual_seed(1))
    grads = []
    outs = []
    for use_checkpoint in (False, True):
        mpu.model_parallel_manual_seed(7, tp_rank=0)
        w, x = w0.clone().requires_grad_(), x0.clone().requires_grad_()
        y = mpu.checkpoint(_block, x, w) if use_checkpoint else _block(x, w)
        # Interleave unrelated random draws between forward and backward.
        torch.rand(100)
        with mpu.get_rng_tracker().fork():
            torch.rand(100)
        y.sum().backward()
        outs.append(y.detach())
        grads.append((x.grad, w.grad))
        after = (torch.rand(3), )
        grads[-1] += after  # the RNG stream after backward is unchanged by recomputation
    assert torch.equal(outs[0], outs[1])
    for a, b in zip(grads[0], grads[1]):
        assert torch.equal(a, b)


def test_tracker_errors_are_clear():
    tracker = mpu.RNGStatesTracker()
    with pytest.raises(RuntimeError, match="model_parallel_manual_seed"):
        with tracker.fork():
            pass
    tracker.add("a", 1)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("a", 2)


def test_checkpoint_rejects_tensor_after_flag():
    with pytest.raises(TypeError):
        mpu.checkpoint(lambda a, f, b: a, torch.ones(1), True, torch.ones(1))



def test_the_tracker_lives_in_the_registry():
    """One tracker per process, held by parallel_state's registry; Megatron's name reads the same one."""
    from megazero.mpu import parallel_state

    assert mpu.get_rng_tracker() is mpu.get_cuda_rng_tracker() is parallel_state._RNG_TRACKER
    assert isinstance(mpu.get_rng_tracker(), mpu.RNGStatesTracker)
