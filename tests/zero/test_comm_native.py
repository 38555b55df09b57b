"""ZeRO's native collectives (all_gather_into_tensor / reduce_scatter_tensor, the path every NCCL
run takes) run over gloo and train exactly as the emulated path the CPU suite takes by default.

Native and emulated runs must agree bit for bit: losses, grad norms, final weights and the
counted traffic. Exact, not within a tolerance, because the arithmetic is the same: gloo's
reduce_scatter_tensor is a copy of the input, an all-reduce and a copy of the rank's chunk (the
emulation's all-reduce, in the same order), and an all-gather only moves bits. What differs is
the plumbing: which buffers and offsets the collectives get, and when their works are waited
for, which is what this checks. NCCL's own summation order (ring or tree) is not covered.
"""

import os

import pytest
import torch

from megazero import mpu
from megazero.zero import comm
from tests.distributed import run_distributed
from tests.zero.common import zero_run

STEPS = 3


def _traffic(engine):
    return engine.comm.collectives, engine.comm.snapshot(), dict(sorted(engine.comm.calls.items()))


def _run_with(collectives: str, tp: int, stage: int, overlap: bool):
    """One training run with ``$MEGAZERO_ZERO_COLLECTIVES=collectives``; also counts how often the
    native flat collectives were called, so a run that silently fell back is caught."""
    native_calls = {"all_gather": 0, "reduce_scatter": 0}
    real = {"all_gather": comm.all_gather_flat, "reduce_scatter": comm.reduce_scatter_flat}

    def counting(kind):
        def call(*args, **kwargs):
            native_calls[kind] += 1
            return real[kind](*args, **kwargs)
        return call

    saved = os.environ.get(comm.COLLECTIVES_ENV)
    os.environ[comm.COLLECTIVES_ENV] = collectives
    comm.all_gather_flat, comm.reduce_scatter_flat = counting("all_gather"), counting("reduce_scatter")
    try:
        # overlap_comm makes the reducer's reduce-scatters asynchronous; two buckets in flight
        # make them really overlap each other as well as the backward.
        zo = {"stage": stage, "stage3_param_persistence_threshold": 0, "overlap_comm": overlap,
              "max_reduce_in_flight": 2 if overlap else 1}
        result = zero_run(tp, stage, steps=STEPS, meta=(stage == 3), extra={"zero_optimization": zo},
                          after=_traffic)
    finally:
        comm.all_gather_flat, comm.reduce_scatter_flat = real["all_gather"], real["reduce_scatter"]
        if saved is None:
            os.environ.pop(comm.COLLECTIVES_ENV, None)
        else:
            os.environ[comm.COLLECTIVES_ENV] = saved
        mpu.destroy_model_parallel()
    return result, native_calls


def _both(tp: int, stage: int, overlap: bool):
    return {c: _run_with(c, tp, stage, overlap) for c in ("native", "emulated")}


# Stage 1 has no reducer (its reduce-scatter runs once, synchronously, in the step), so
# overlap_comm does not apply to it.
CASES = [(stage, overlap) for stage in (1, 2, 3) for overlap in ((False,) if stage == 1 else (False, True))]


@pytest.mark.parametrize("tp,dp", [(2, 2), (1, 4)])
@pytest.mark.parametrize("stage,overlap", CASES)
def test_native_collectives_match_emulated(stage, overlap, tp, dp):
    results = run_distributed(4, _both, tp, stage, overlap)
    what = f"stage {stage} tp={tp} dp={dp} overlap={overlap}"
    for rank, runs in enumerate(results):
        (n_losses, n_norms, n_sd, n_traffic), n_native = runs["native"]
        (e_losses, e_norms, e_sd, e_traffic), e_native = runs["emulated"]
        assert n_traffic[0] == "native" and e_traffic[0] == "emulated"
        # The native run issued the flat collectives (every step reduce-scatters the gradients and
        # all-gathers the updated partitions, or ZeRO-3's window gathers them); the emulated one
        # none of them.
        assert n_native["reduce_scatter"] >= STEPS and n_native["all_gather"] >= STEPS, \
            f"{what} rank {rank}: {n_native}"
        assert e_native == {"all_gather": 0, "reduce_scatter": 0}, f"{what} rank {rank}: {e_native}"
        assert n_traffic[1:] == e_traffic[1:], f"{what} rank {rank}: traffic {n_traffic} vs {e_traffic}"
        assert n_losses == e_losses, f"{what} rank {rank}: losses {n_losses} vs {e_losses}"
        assert n_norms == e_norms, f"{what} rank {rank}: grad norms {n_norms} vs {e_norms}"
        assert n_sd.keys() == e_sd.keys()
        for k in n_sd:
            diff = float((n_sd[k].double() - e_sd[k].double()).abs().max())
            assert torch.equal(n_sd[k], e_sd[k]), f"{what} rank {rank}: weight {k} differs by up to {diff:.3g}"


def test_branch_choice(monkeypatch):
    monkeypatch.delenv(comm.COLLECTIVES_ENV, raising=False)
    assert comm.CommCounter({}).collectives == "auto"
    monkeypatch.setenv(comm.COLLECTIVES_ENV, " Native ")
    assert comm.CommCounter({}).collectives == "native"
    # An explicit argument wins over the environment, which is read at construction only.
    assert comm.CommCounter({}, collectives="emulated").collectives == "emulated"
    counter = comm.CommCounter({})
    monkeypatch.setenv(comm.COLLECTIVES_ENV, "emulated")
    assert counter.collectives == "native"
    monkeypatch.setenv(comm.COLLECTIVES_ENV, "nccl")
    with pytest.raises(ValueError, match="MEGAZERO_ZERO_COLLECTIVES"):
        comm.CommCounter({})
