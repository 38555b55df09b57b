"""Forward and backward of every autograd collective, with values worked out by hand."""

import torch
import torch.distributed as dist

from megazero import mpu
from tests.distributed import run_distributed


def _mappings(tp):
    mpu.initialize_model_parallel(tp)
    r = mpu.get_tensor_model_parallel_rank()

    def run(fn, x, grad_out):
        x = x.clone().requires_grad_()
        y = fn(x)
        y.backward(grad_out)
        return y.detach(), x.grad

    # A per-rank value: row r of x is (r+1).
    base = torch.arange(tp * 2, dtype=torch.float32).view(tp * 2, 1).repeat(1, tp * 2)
    mine = torch.full((2, 2), float(r + 1))

    y, gx = run(mpu.copy_to_tensor_model_parallel_region, mine, torch.ones(2, 2) * (r + 1))
    assert torch.equal(y, mine) and torch.equal(gx, torch.full((2, 2), tp * (tp + 1) / 2))

    y, gx = run(mpu.reduce_from_tensor_model_parallel_region, mine, torch.full((2, 2), 3.0))
    assert torch.equal(y, torch.full((2, 2), tp * (tp + 1) / 2)) and torch.equal(gx, torch.full((2, 2), 3.0))

    y, gx = run(mpu.scatter_to_tensor_model_parallel_region, base, torch.ones(tp * 2, 2) * (r + 1))
    assert torch.equal(y, base[:, 2 * r:2 * r + 2])
    expected = torch.cat([torch.ones(tp * 2, 2) * (k + 1) for k in range(tp)], dim=-1)
    assert torch.equal(gx, expected)

    y, gx = run(mpu.gather_from_tensor_model_parallel_region, mine, torch.arange(2.0 * tp).repeat(2, 1))
    assert torch.equal(y, torch.cat([torch.full((2, 2), k + 1.0) for k in range(tp)], dim=-1))
    assert torch.equal(gx, torch.arange(2.0 * tp).repeat(2, 1)[:, 2 * r:2 * r + 2])

    y, gx = run(mpu.scatter_to_sequence_parallel_region, base, torch.ones(2, tp * 2) * (r + 1))
    assert torch.equal(y, base[2 * r:2 * r + 2])
    assert torch.equal(gx, torch.cat([torch.ones(2, tp * 2) * (k + 1) for k in range(tp)], dim=0))

    y, gx = run(mpu.gather_from_sequence_parallel_region, mine, torch.ones(2 * tp, 2) * (r + 1))
    assert torch.equal(y, torch.cat([torch.full((2, 2), k + 1.0) for k in range(tp)], dim=0))
    assert torch.equal(gx, torch.full((2, 2), tp * (tp + 1) / 2))  # reduce-scatter of partial grads

    y, gx = run(lambda t: mpu.gather_from_sequence_parallel_region(t, tensor_parallel_output_grad=False),
                mine, torch.arange(2.0 * tp).view(-1, 1).repeat(1, 2))
    assert torch.equal(gx, torch.arange(2.0 * tp).view(-1, 1).repeat(1, 2)[2 * r:2 * r + 2])  # plain split

    y, gx = run(mpu.reduce_scatter_to_sequence_parallel_region, base + r, torch.full((2, tp * 2), r + 1.0))
    assert torch.equal(y, (tp * base + sum(range(tp)))[2 * r:2 * r + 2])
    assert torch.equal(gx, torch.cat([torch.full((2, tp * 2), k + 1.0) for k in range(tp)], dim=0))

    # A leaf passed in (as above) is left alone; a layer's fresh partial sum is reduced in place (no
    # copy per layer); an input that an earlier op saved for backward fails loudly, not silently.
    leaf = mine.clone().requires_grad_()
    mpu.reduce_from_tensor_model_parallel_region(leaf)
    assert torch.equal(leaf.detach(), mine)
    partial = leaf * 2
    y = mpu.reduce_from_tensor_model_parallel_region(partial)
    assert y is partial and torch.equal(y, torch.full((2, 2), tp * (tp + 1.0)))
    y.sum().backward()
    assert torch.equal(leaf.grad, torch.full((2, 2), 2.0))
    saved = leaf.exp()  # exp's backward needs its output
    y = mpu.reduce_from_tensor_model_parallel_region(saved)
    try:
        y.sum().backward()
        raise AssertionError("a saved input reduced in place must fail in backward")
    except RuntimeError as e:
        assert "inplace operation" in str(e), e

    # Explicit group argument is honoured even with the registry present.
    y = mpu.reduce_from_tensor_model_parallel_region(torch.ones(1), group=dist.group.WORLD)
    assert float(y) == dist.get_world_size()
    return True


def test_mappings_tp2():
    assert all(run_distributed(4, _mappings, 2))


def test_mappings_tp4():
    assert all(run_distributed(4, _mappings, 4))
