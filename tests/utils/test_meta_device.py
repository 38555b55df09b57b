"""megazero.utils.meta_device: the meta device standing in for a GPU (host reads, values that came
from the host through a fake process group, the kernel cache, CUDA's attention kernel)."""

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.utils.meta_device import MetaDeviceMode, cuda_kernels_on_meta


def test_host_values_survive_collectives_and_device_results_read_as_zeros():
    dist.init_process_group("cpu:fake,meta:fake", store=FakeStore(), rank=3, world_size=8)
    reads, collectives = [], []
    try:
        with MetaDeviceMode(on_read=lambda: reads.append(1), on_collective=lambda f, a: collectives.append(f)) as m:
            flags = torch.tensor([1, 0, 1], dtype=torch.uint8).to("meta")
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)  # every peer holds the same: MAX keeps it
            assert flags.cpu().tolist() == [1, 0, 1] and flags[1:].tolist() == [0, 1]
            sums = torch.zeros(3, dtype=torch.float64, device="meta")
            sums[0] = torch.ones((), dtype=torch.float64, device="meta") * 5  # computed on the device: unknown
            sums[2].fill_(2.0)
            dist.all_reduce(sums)  # SUM over 8 alike ranks
            assert sums.tolist() == [0.0, 0.0, 16.0] and sums[2].item() == 16.0
            counted = torch.ones(4, device="meta")
            counted.add_(1)  # written by a kernel: unknown from now on
            assert counted.tolist() == [0.0] * 4
            assert not bool(torch.ones(100_000, device="meta")[0])  # too large to keep values
        assert len(reads) == 6 and collectives == [torch.ops.c10d.allreduce_.default] * 2
        del flags, sums, counted
        assert m.values.flat == {}  # forgotten with their storages
    finally:
        dist.destroy_process_group()


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.seen.append(func)
        return func(*args, **(kwargs or {}))


def test_cached_kernels_give_the_same_outputs_and_attention_is_cudas():
    x = torch.empty(64, 2, 32, device="meta", dtype=torch.bfloat16).transpose(0, 1)  # non-contiguous input
    with MetaDeviceMode() as m:
        first = [F.gelu(x), x + x, x.float().sum(-1), F.layer_norm(x, (32,))]
        again = [F.gelu(x), x + x, x.float().sum(-1), F.layer_norm(x, (32,))]
    assert m.cache.hits >= 4
    for a, b in zip(first, again):
        assert (a.shape, a.stride(), a.dtype, a.untyped_storage().nbytes()) == \
               (b.shape, b.stride(), b.dtype, b.untyped_storage().nbytes())
    q = torch.empty(2, 4, 256, 16, device="meta", dtype=torch.bfloat16, requires_grad=True)
    ops = _Ops()
    with cuda_kernels_on_meta(), ops:
        F.scaled_dot_product_attention(q, q, q, is_causal=True, dropout_p=0.1).sum().backward()
    assert torch.ops.aten._scaled_dot_product_flash_attention_backward.default in ops.seen
    assert torch.ops.aten.bmm.default not in ops.seen  # no s x s scores
    with _Ops() as after:  # removed on exit: meta's own (math) decomposition again
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
    assert torch.ops.aten.bmm.default in after.seen
    x = torch.empty(64, 32, device="meta", dtype=torch.bfloat16, requires_grad=True)
    saved = []
    with cuda_kernels_on_meta(), torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t,
                                                                         lambda t: t):
        F.dropout(x * 1.0, 0.1)
    assert saved == [torch.bool]  # CUDA's fused dropout keeps a one-byte mask
