"""ZeRO holds what it promises *during* a step: gathered weights die with their unit,
gradients leave in bounded buckets, and the measured peak fits a formula of the parts."""

import pytest
import torch

from megazero import mpu, zero
from megazero.model import GPTModel
from megazero.utils.memory_tracker import LiveMemoryTracker
from tests.distributed import run_distributed
from tests.zero.common import SEED, batches, ds_config, tiny_config

SHAPE = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=120)


def _engine(tp, stage, model_overrides=None, **zero_opts):
    mpu.initialize_model_parallel(tp)
    torch.manual_seed(SEED)
    model = GPTModel(tiny_config(**SHAPE, **(model_overrides or {})), device="meta" if stage == 3 else None)
    cfg = ds_config(stage, micro=2)
    cfg["zero_optimization"].update(zero_opts)
    return zero.initialize(model, cfg, mpu=mpu)


def _rows(step=0):
    dp_rank = mpu.get_data_parallel_rank()
    return batches(step + 1, 1, 8)[step, 0][dp_rank * 2:dp_rank * 2 + 2]


def _after_forward(recompute, sp):
    engine = _engine(2, 3, {"recompute_granularity": recompute, "sequence_parallel": sp})
    rows = _rows()
    loss = engine(rows[:, :-1], labels=rows[:, 1:]).mean()
    window = engine.window
    alive = sum(g.full.untyped_storage().nbytes() for g in engine.groups if not g.resident)
    saved_weights = sum(1 for e in window.trace if e.saved)  # forward entries whose weights autograd saved
    engine.backward(loss)
    engine.step()
    return alive, window.live_numel, saved_weights, len(window.units)


@pytest.mark.parametrize("recompute,sp", [(None, False), ("selective", False), ("full", False), (None, True),
                                          ("full", True)])
def test_no_gathered_weight_outlives_its_forward(recompute, sp):
    for alive, live_numel, saved, units in run_distributed(4, _after_forward, recompute, sp):
        # autograd saved references to the weights of every unit it will need (all of them
        # except the lookup tables)...
        assert saved >= units - 2, (saved, units)
        # ...and they cost nothing: every gathered buffer has given its storage back.
        assert alive == 0 and live_numel == 0, (alive, live_numel)


def _peak(tp, stage):
    # A window of one unit ahead, buckets of about one layer, at most one reduction in flight.
    engine = _engine(tp, stage, stage3_prefetch_bucket_size=1, reduce_bucket_size=20_000, max_reduce_in_flight=1)
    rows = _rows()
    with LiveMemoryTracker("cpu") as t:
        before = t.current_bytes
        loss = engine(rows[:, :-1], labels=rows[:, 1:]).mean()
        activations = t.current_bytes - before  # ZeRO-3: no weights in here (tested above)
        engine.backward(loss)
        engine.step()
        t.settle()
        peak = t.peak_bytes
    units = [u for u in engine.units if u.name != "persistent"]
    elem = 4  # fp32 run
    unit_full = max(u.numel() for u in units) * elem
    if stage == 3:
        # the unit in use and the one prefetched, plus the tied embedding held by the output layer
        window = 2 * unit_full + engine.module.embedding.weight.numel() * elem
    else:
        window = 0
    reducer = engine.reducer
    bucket = 20_000 + max(sum(g.padded_numel for g in u.trainable_groups) for u in units)
    # autograd's full-size gradients of the units not yet bucketed, the bucket being filled,
    # the one in flight (and its output), and the embedding gradient of the tied head + lookup
    grads = 2 * unit_full + 3 * bucket * elem + engine.module.embedding.weight.numel() * elem
    bound = activations + window + grads
    state = engine.model_state_bytes()["total"]
    return peak, bound, activations, reducer.peak_bucket_bytes, bucket * elem


@pytest.mark.parametrize("tp,stage", [(1, 2), (1, 3), (2, 2), (2, 3)])
def test_step_peak_fits_state_plus_activations_plus_window(tp, stage):
    for peak, bound, activations, bucket_bytes, one_bucket in run_distributed(4, _peak, tp, stage):
        # Above the state held at entry, the step's peak is the activations plus the bounded window
        # of gathered weights and of gradients in flight.
        assert peak <= 1.10 * bound, (peak, bound, activations)
        # at most max_reduce_in_flight (1) bucket being reduced and one being sent
        assert bucket_bytes <= 2 * one_bucket, (bucket_bytes, one_bucket)


def _stage_peak(stage):
    engine = _engine(1, stage, stage3_prefetch_bucket_size=1, reduce_bucket_size=20_000)
    rows = _rows()
    with LiveMemoryTracker("cpu") as t:
        engine.backward(engine(rows[:, :-1], labels=rows[:, 1:]).mean())
        engine.step()
    # model state held all along (after the first step: Adam moments included) + the step's transient peak
    return engine.model_state_bytes()["total"] + t.peak_bytes


def test_zero3_peak_is_below_zero1():
    z1 = run_distributed(4, _stage_peak, 1)
    z3 = run_distributed(4, _stage_peak, 3)
    for a, b in zip(z1, z3):
        assert b < 0.9 * a, (a, b)  # at this size activations dominate; see benchmarks/bench_zero_memory.py
