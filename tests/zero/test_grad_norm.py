"""The step's gradient norm on one rank: each element counted once, the rest still checked."""

import pytest
import torch

from megazero import mpu, zero
from megazero.model import GPTModel
from tests.distributed import run_distributed
from tests.zero.common import SEED, batches, ds_config, tiny_config


def _gaps(ranges: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    out, pos = [], 0
    for lo, hi in ranges:
        if lo > pos:
            out.append((pos, lo))
        pos = hi
    return out + ([(pos, n)] if pos < n else [])


def _sum_squares_on_each_rank(stage: int):
    mpu.initialize_model_parallel(2)  # tp 2 x dp 2
    torch.manual_seed(SEED)
    engine = zero.initialize(GPTModel(tiny_config()), ds_config(stage), mpu=mpu)
    rows = batches(1, 1, 4)[0, 0][mpu.get_data_parallel_rank() * 2:][:2]
    engine.backward(engine(rows[:, :-1], labels=rows[:, 1:]).mean())
    grads = engine._local_grads()
    count_any = engine.stage > 0 or engine.dp_rank == 0
    ranges = {g: g.norm_ranges(count_replicated=engine.tp_rank == 0, count_any=count_any) for g in grads}
    # The reference: a square per element, summed in fp64, over the counted ranges only.
    ref = sum(float(t[lo:hi].double().square().sum()) for g, t in grads.items() for lo, hi in ranges[g])
    got = engine._sum_squares(grads)
    uncounted = [(t, lo, hi) for g, t in grads.items() for lo, hi in _gaps(ranges[g], t.numel())
                 if t[lo:hi].abs().sum() > 0]  # real gradients, not the partition's padding
    poisoned = []
    for value in (float("inf"), float("nan")):
        if uncounted:
            t, lo, _ = uncounted[0]
            keep = t[lo].clone()
            t[lo] = value
            poisoned.append(float(engine._sum_squares(grads)))
            t[lo] = keep
    return engine.tp_rank, engine.dp_rank, float(got), ref, len(uncounted), poisoned, got.dtype


@pytest.mark.parametrize("stage", [0, 3])
def test_gradient_norm_counts_each_element_once_and_checks_the_rest(stage):
    results = run_distributed(4, _sum_squares_on_each_rank, stage)
    for tp_rank, dp_rank, got, ref, n_uncounted, poisoned, dtype in results:
        assert dtype == torch.float64
        assert got == pytest.approx(ref, rel=1e-6)
        assert (got > 0) == (stage > 0 or dp_rank == 0)  # at stage 0 DP rank 0 counts for its DP group
        # TP rank 1 leaves the replicated parameters (norms, row-parallel biases) to TP rank 0, and at
        # stage 0 DP rank 1 leaves everything to DP rank 0: those elements are uncounted there, yet an
        # inf or a nan in them must still poison this rank's sum (the step is then skipped everywhere).
        expect_uncounted = tp_rank == 1 or (stage == 0 and dp_rank == 1)
        assert (n_uncounted > 0) == expect_uncounted, (tp_rank, dp_rank, n_uncounted)
        if expect_uncounted:
            assert len(poisoned) == 2 and all(v != v for v in poisoned), poisoned
