"""Batched isend/irecv over the PP group, driven by real schedules (gloo, 2 and 4 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megazero import mpu
from megazero.pipeline.p2p import PipeP2P
from megazero.pipeline.schedules import ACTIVATION, Exchange, build_schedule, virtual_stage
from tests.distributed import run_distributed

SHAPE = (3, 2, 5)  # [s (or s/tp under SP), micro-batch, h]


def _code(what, mb, vstage, tp_rank):
    return (1000 if what == ACTIVATION else 2000) + 100 * tp_rank + 10 * vstage + mb


def _run_schedule_transfers(tp, pp, v, m):
    groups = mpu.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=v if v > 1 else None)
    p2p = PipeP2P(groups.pp_group, groups.pp_ranks)
    r = groups.pp_rank
    received = []
    for step in build_schedule(pp, v, m, r):
        if not isinstance(step, Exchange):
            continue
        sends = [(t.peer, torch.full(SHAPE, float(_code(t.what, t.microbatch, virtual_stage(pp, r, t.chunk), groups.tp_rank))))
                 for t in step.transfers if t.send]
        recv_ts = [t for t in step.transfers if not t.send]
        got = p2p.exchange(sends, [(t.peer, SHAPE, torch.float32) for t in recv_ts])
        for t, buf in zip(recv_ts, got):
            vs = virtual_stage(pp, r, t.chunk)
            src = vs - 1 if t.what == ACTIVATION else vs + 1  # the producing virtual stage
            expected = _code(t.what, t.microbatch, src, groups.tp_rank)
            assert torch.equal(buf, torch.full(SHAPE, float(expected))), (r, t, buf.flatten()[0].item(), expected)
            received.append(expected)
    return len(received), p2p.bytes_sent, p2p.bytes_received


@pytest.mark.parametrize("pp,v,m", [(2, 1, 3), (2, 2, 4)])
def test_schedule_transfers_2_ranks(pp, v, m):
    out = run_distributed(2, _run_schedule_transfers, 1, pp, v, m)
    n_boundaries = pp * v - 1
    assert sum(n for n, _, _ in out) == 2 * m * n_boundaries
    assert sum(s for _, s, _ in out) == sum(r for _, _, r in out) == 2 * m * n_boundaries * 30 * 4


@pytest.mark.parametrize("tp,pp,v,m", [(1, 4, 1, 5), (1, 4, 2, 8), (2, 2, 2, 2)])
def test_schedule_transfers_4_ranks(tp, pp, v, m):
    out = run_distributed(4, _run_schedule_transfers, tp, pp, v, m)
    assert sum(n for n, _, _ in out) == 2 * m * (pp * v - 1) * tp


def _bad_peer():
    groups = mpu.initialize_model_parallel(1, 2)
    try:
        PipeP2P(groups.pp_group, groups.pp_ranks).exchange([(2, torch.zeros(1))], [])
    except ValueError as e:
        return str(e)


def test_peer_outside_pipeline_refused():
    assert "outside this pipeline of 2 stages" in run_distributed(2, _bad_peer)[0]
