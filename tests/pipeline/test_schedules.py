"""The pure schedule function: Megatron's order, matched transfers, no deadlock, exact bubble."""

from __future__ import annotations

import itertools

import pytest

from megazero.pipeline.schedules import (ACTIVATION, BACKWARD, FORWARD, GRADIENT, Compute, Exchange, ScheduleError,
                                         build_schedule, check_schedule_args, num_warmup_microbatches, simulate,
                                         virtual_stage)

GRID = [(pp, v, m) for pp in (1, 2, 3, 4, 8) for v in (1, 2, 3, 4) for m in range(1, 18)
        if not (pp == 1 and v > 1) and not (v > 1 and m % pp)]


# ---- Megatron-core's loops, written out call by call (forward_backward_pipelining_*) -------------

def megatron_1f1b(pp, m, rank):
    """Compute order and p2p calls of forward_backward_pipelining_without_interleaving."""
    first, last = rank == 0, rank == pp - 1
    out = []
    warmup = min(pp - rank - 1, m)
    remaining = m - warmup
    for i in range(warmup):
        out += [] if first else [("recv_forward",)]
        out += [("F", i, 0)]
        out += [] if last else [("send_forward",)]
    if remaining > 0 and not first:
        out += [("recv_forward",)]
    for i in range(remaining):
        out += [("F", warmup + i, 0)]
        out += [] if last else [("send_forward_recv_backward",)]
        out += [("B", i, 0)]
        if i == remaining - 1:
            out += [] if first else [("send_backward",)]
        else:
            out += [] if first else [("send_backward_recv_forward",)]
    for i in range(remaining, m):
        out += [] if last else [("recv_backward",)]
        out += [("B", i, 0)]
        out += [] if first else [("send_backward",)]
    return out


def megatron_interleaved_compute(pp, v, m, rank):
    """Compute order of forward_backward_pipelining_with_interleaving (group size = pp)."""
    total = m * v
    warmup = (pp - rank - 1) * 2 + (v - 1) * pp
    warmup = min(warmup, total)

    def get_model_chunk_id(k, forward):
        c = (k % (pp * v)) // pp
        return c if forward else v - c - 1

    def get_microbatch_id_in_model_chunk(k):
        return (k // (pp * v)) * pp + k % pp

    order = [("F", get_microbatch_id_in_model_chunk(k), get_model_chunk_id(k, True)) for k in range(warmup)]
    for k in range(total - warmup):
        order.append(("F", get_microbatch_id_in_model_chunk(k + warmup), get_model_chunk_id(k + warmup, True)))
        order.append(("B", get_microbatch_id_in_model_chunk(k), get_model_chunk_id(k, False)))
    order += [("B", get_microbatch_id_in_model_chunk(k), get_model_chunk_id(k, False)) for k in range(total - warmup, total)]
    return order, warmup


def _as_megatron_calls(steps, rank, pp):
    """Our steps in Megatron's vocabulary: compute as (F|B, mb, chunk), 1F1B exchanges by name."""
    out = []
    for s in steps:
        if isinstance(s, Compute):
            out.append(("F" if s.kind == FORWARD else "B", s.microbatch, s.chunk))
            continue
        kinds = {(t.send, t.what) for t in s.transfers}
        name = {frozenset({(False, ACTIVATION)}): "recv_forward",
                frozenset({(True, ACTIVATION)}): "send_forward",
                frozenset({(False, GRADIENT)}): "recv_backward",
                frozenset({(True, GRADIENT)}): "send_backward",
                frozenset({(True, ACTIVATION), (False, GRADIENT)}): "send_forward_recv_backward",
                frozenset({(True, GRADIENT), (False, ACTIVATION)}): "send_backward_recv_forward"}[frozenset(kinds)]
        out.append((name,))
    return out


@pytest.mark.parametrize("pp,m", [(pp, m) for pp in (2, 3, 4, 8) for m in (1, 2, 3, 4, 5, 8, 9, 17)])
def test_1f1b_equals_megatron_call_by_call(pp, m):
    for rank in range(pp):
        assert _as_megatron_calls(build_schedule(pp, 1, m, rank), rank, pp) == megatron_1f1b(pp, m, rank), (pp, m, rank)


@pytest.mark.parametrize("pp,v,m", [g for g in GRID if g[1] > 1])
def test_interleaved_compute_order_equals_megatron(pp, v, m):
    for rank in range(pp):
        steps = build_schedule(pp, v, m, rank)
        order = [("F" if s.kind == FORWARD else "B", s.microbatch, s.chunk) for s in steps if isinstance(s, Compute)]
        expected, warmup = megatron_interleaved_compute(pp, v, m, rank)
        assert order == expected, (pp, v, m, rank)
        assert num_warmup_microbatches(pp, v, m, rank) == warmup
        # Warm-up forwards, then (unless all are warm-up) the steady phase's first forward.
        assert next(i for i, o in enumerate(order) if o[0] == "B") == warmup + (warmup < m * v)


def test_warmup_counts_worked_examples():
    # 1F1B, pp 4: 3, 2, 1, 0 warm-up forwards; capped by m.
    assert [num_warmup_microbatches(4, 1, 8, r) for r in range(4)] == [3, 2, 1, 0]
    assert [num_warmup_microbatches(4, 1, 2, r) for r in range(4)] == [2, 2, 1, 0]
    # Interleaved pp 4, v 2, m 8: (4 - r - 1) * 2 + (2 - 1) * 4.
    assert [num_warmup_microbatches(4, 2, 8, r) for r in range(4)] == [10, 8, 6, 4]
    # m = pp: the first ranks run everything as warm-up (capped at m * v = 8).
    assert [num_warmup_microbatches(4, 2, 4, r) for r in range(4)] == [8, 8, 6, 4]


def test_no_pipeline_is_forward_backward_per_microbatch():
    assert build_schedule(1, 1, 3, 0) == [Compute(FORWARD, 0), Compute(BACKWARD, 0), Compute(FORWARD, 1),
                                          Compute(BACKWARD, 1), Compute(FORWARD, 2), Compute(BACKWARD, 2)]


@pytest.mark.parametrize("pp,v,m", GRID)
def test_every_compute_once_and_every_message_matched(pp, v, m):
    schedules = [build_schedule(pp, v, m, r) for r in range(pp)]
    sent: dict[tuple[int, int], list] = {}
    received: dict[tuple[int, int], list] = {}
    for r, steps in enumerate(schedules):
        computes = [(s.kind, s.microbatch, s.chunk) for s in steps if isinstance(s, Compute)]
        assert sorted(computes) == sorted((k, mb, c) for k in (FORWARD, BACKWARD) for mb in range(m) for c in range(v))
        for mb, c in itertools.product(range(m), range(v)):  # backward after its forward
            assert computes.index((FORWARD, mb, c)) < computes.index((BACKWARD, mb, c))
        done = set()
        for s in steps:
            if isinstance(s, Compute):
                done.add((s.kind, s.microbatch, s.chunk))
                continue
            for t in s.transfers:
                vs = virtual_stage(pp, r, t.chunk)
                if t.send:
                    # A tensor is sent after the computation that produced it.
                    assert ((FORWARD if t.what == ACTIVATION else BACKWARD), t.microbatch, t.chunk) in done
                    dest = vs + 1 if t.what == ACTIVATION else vs - 1
                    assert t.peer == dest % pp and 0 <= dest < pp * v
                    sent.setdefault((r, t.peer), []).append((t.what, t.microbatch, dest))
                else:
                    # ... and received before the computation that consumes it.
                    assert ((FORWARD if t.what == ACTIVATION else BACKWARD), t.microbatch, t.chunk) not in done
                    src = vs - 1 if t.what == ACTIVATION else vs + 1
                    assert t.peer == src % pp
                    received.setdefault((t.peer, r), []).append((t.what, t.microbatch, vs))
    # Per channel, the same messages in the same order at both ends.
    assert sent == received
    # Every stage boundary carries each micro-batch's activation forward and gradient back once.
    n_boundaries = pp * v - 1
    assert sum(len(x) for x in sent.values()) == 2 * m * n_boundaries


@pytest.mark.parametrize("pp,v,m", [g for g in GRID if g[0] > 1])
def test_unit_cost_simulation_bubble_is_exact(pp, v, m):
    res = simulate([build_schedule(pp, v, m, r) for r in range(pp)], forward_cost=1, backward_cost=2)
    assert res.ideal == 3 * m * v
    assert res.bubble_fraction == pytest.approx((pp - 1) / (v * m), abs=1e-12)


@pytest.mark.parametrize("pp,m", [(2, 2), (4, 4), (4, 9), (8, 3)])
def test_1f1b_live_activations_at_most_pp_minus_rank(pp, m):
    res = simulate([build_schedule(pp, 1, m, r) for r in range(pp)])
    assert res.max_live_activations == [min(pp - r, m) for r in range(pp)]


def test_simulation_detects_deadlock_and_unmatched_messages():
    good = [build_schedule(2, 1, 2, r) for r in range(2)]
    with pytest.raises(ScheduleError, match="1 sends but 0 receives|sends but"):
        simulate([good[0], [s for s in good[1] if not isinstance(s, Exchange) or s.transfers[0].send]])
    # Both ranks receive before they send: classic deadlock.
    swapped = [list(good[0]), list(good[1])]
    r1 = [s for s in swapped[1] if isinstance(s, Exchange)]
    first_recv = r1[0]
    swapped[1].remove(first_recv)
    swapped[1].append(first_recv)
    with pytest.raises(ScheduleError, match="deadlock"):
        simulate(swapped)


def test_bad_arguments_are_refused_with_numbers():
    with pytest.raises(ScheduleError, match=r"micro-batches \(6\) to be a multiple of the pipeline size \(4\).*use 8 or 4"):
        build_schedule(4, 2, 6, 0)
    with pytest.raises(ScheduleError, match="need a pipeline"):
        check_schedule_args(1, 2, 4)
    with pytest.raises(ScheduleError, match=r"rank 4 is outside \[0, 4\)"):
        build_schedule(4, 1, 4, 4)
    with pytest.raises(ScheduleError, match=">= 1"):
        build_schedule(2, 1, 0, 0)
