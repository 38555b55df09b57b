"""The offload rings' size: by default a small share of the state they stream, at any scale.

The optimizer offload's ring (``megazero.zero.offload.ring_chunk``) and the parameter offload's
NVMe buffers (``megazero.zero.param_offload.ring_bytes``): DeepSpeed's ``buffer_size`` honoured
when given; unset, a fixed chunk capped at ``RING_SHARE`` of what is offloaded and never above
the sizing by the largest group (or DeepSpeed's 1e8 elements). Chunking differently leaves the
step bit-identical to the one on the device.
"""

from __future__ import annotations

import pytest
import torch

from megazero import mpu
from megazero.zero.offload import ALIGN, DEFAULT_CHUNK, RING_SHARE, ring_chunk
from megazero.zero.param_offload import DEEPSPEED_BUFFER_SIZE, ring_bytes
from tests.distributed import run_distributed
from tests.zero.test_offload import _engine, _param_bytes, _train

M = 1 << 20
# (elements offloaded, largest group): a tiny model, a 76M-parameter GPT's partition at dp 2, 1.3B at dp 8, 13B at dp 1
SCALES = [(30_000, 12_000), (38 * M, 20 * M), (160 * M, 8 * M), (13_000 * M, 600 * M)]


@pytest.mark.parametrize("nvme", [False, True])
@pytest.mark.parametrize("count", [1, 4, 16])
@pytest.mark.parametrize("offloaded, largest", SCALES)
def test_default_ring_is_a_small_share_of_the_offloaded_state(offloaded, largest, count, nvme):
    chunk = ring_chunk(offloaded, largest, count, None, nvme)
    assert chunk % ALIGN == 0 and ALIGN <= chunk <= DEFAULT_CHUNK
    deepspeed_sized = min(1 << 23, -(-largest // ALIGN) * ALIGN)  # buffer_size's former default, capped by the group
    assert chunk <= deepspeed_sized
    ring = count * chunk * 4 * (4 if nvme else 1)
    if chunk > ALIGN:  # not held up by the alignment floor
        assert ring <= RING_SHARE * 12 * offloaded


def test_given_buffer_size_is_honoured_as_before():
    assert ring_chunk(38 * M, 20 * M, 4, 8192, True) == 8192
    assert ring_chunk(38 * M, 20 * M, 4, 5000, False) == ALIGN  # rounded down to ALIGN
    assert ring_chunk(38 * M, 20 * M, 4, 1 << 23, True) == 1 << 23  # even above the default share
    assert ring_chunk(30_000, 12_000, 4, 1 << 23, True) == 12_288  # never above the largest group


def test_param_ring_default_is_a_small_share_of_what_is_on_nvme():
    assert ring_bytes([], 2, 5, None) == 0
    for parts in ([12_000, 3_000], [20 * M, 18 * M], [300 * M] * 40):
        for elem, count in ((2, 5), (4, 2)):
            size = ring_bytes(parts, elem, count, None)
            assert size <= min(max(parts), DEEPSPEED_BUFFER_SIZE) * elem and size <= DEFAULT_CHUNK * elem
            if size > ALIGN * elem and size < max(parts) * elem:
                assert count * size <= RING_SHARE * sum(parts) * elem
    assert ring_bytes([20 * M], 2, 5, 500) == 1000  # buffer_size given: honoured
    assert ring_bytes([300], 2, 5, 500) == 600  # at most the largest partition


def _default_vs_on_device(path: str):
    on_device = _engine(None, hidden_size=64)
    reference = _train(on_device, 2)
    masters = [g.master.detach().clone() for g in on_device.groups]
    mpu.destroy_model_parallel()
    engine = _engine({"device": "nvme", "nvme_path": path, "buffer_count": 2}, hidden_size=64)
    off = engine.offload
    losses = _train(engine, 2)
    part = sum(g.shard_numel for g in off.groups)
    same = [torch.equal(a, g.master) for a, g in zip(masters, engine.groups)]
    host = engine.model_state_bytes()
    engine.offload.release()
    return reference, losses, same, off.chunk, max(g.shard_numel for g in off.groups), part, host


def test_default_chunks_step_bit_identical_to_the_device(tmp_path):
    for reference, losses, same, chunk, largest, part, host in run_distributed(2, _default_vs_on_device, str(tmp_path)):
        assert chunk == ALIGN < largest  # several chunks per group
        assert losses == reference and all(same)
        assert host["host_ring"] == 2 * chunk * 16 and host["nvme"] == 12 * part


def test_param_offload_ring_default_is_bounded_by_what_is_on_nvme(tmp_path):
    nvme = {"device": "nvme", "nvme_path": str(tmp_path), "max_in_cpu": 0, "buffer_count": 3}
    for state, part, count, chunk, *_ in run_distributed(2, _param_bytes, nvme, None, True):
        assert count == 3 and state["nvme_params"] == part
        assert 0 < chunk <= max(ALIGN * 2, RING_SHARE * part / count)  # bf16: 2 B per element
