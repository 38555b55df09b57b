"""ZeRO-2/3 agree on what each forward used once, then follow the kept record without a host sync;
a forward the record does not cover skips that step on every rank and the engine agrees again.

The model is ``tests/zero/test_edge_cases.Net``; each rank's control flow per step is given by
``skips[step][rank]`` (the block it skips, or None).
"""

import pytest
import torch
import torch.distributed as dist

from megazero import zero
from tests.distributed import run_distributed
from tests.zero.test_edge_cases import LR, WD, Net, _data


def _engine(stage):
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 1}}
    return zero.initialize(Net("conditional"), cfg)


def _train(stage, skips):
    engine = _engine(stage)
    rank, log = dist.get_rank(), []
    for step, skip in enumerate(skips):
        ids, labels = _data(step)
        engine.backward(engine(ids[rank * 2:rank * 2 + 2], labels[rank * 2:rank * 2 + 2], skip[rank]).mean())
        updated = engine.step()
        log.append((updated, engine.agreement.agreeing))
    return log, engine.consolidated_state_dict(rank0_only=False)


def _reference(skips):
    torch.manual_seed(0)
    model = Net("conditional")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    for step, skip in enumerate(skips):
        if skip is None:  # a step every rank skipped
            continue
        ids, labels = _data(step)
        opt.zero_grad()
        loss = sum(model(ids[r * 2:r * 2 + 2], labels[r * 2:r * 2 + 2], skip[r]).mean() for r in range(2)) / 2
        loss.backward()
        for p in model.parameters():  # ZeRO gives a parameter no rank used a zero gradient (decay applies)
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)
        opt.step()
    return model.state_dict()


@pytest.mark.parametrize("stage", [2, 3])
def test_a_rank_skipping_a_layer_after_the_first_step_is_covered_by_the_kept_record(stage):
    # Step 0: every rank runs every block (agreed, equal): static from step 1. Steps 1-2: rank 0
    # skips block 1, which the kept record covers: its gradient goes out as zeros, no sync, exact.
    skips = [(None, None), (1, None), (1, None)]
    ref = _reference(skips)
    for log, sd in run_distributed(2, _train, stage, skips):
        assert log == [(True, False), (True, False), (True, False)], log
        for k, v in ref.items():
            torch.testing.assert_close(sd[k], v, atol=1e-5, rtol=1e-5, msg=lambda m: f"stage {stage} {k}: {m}")


def test_a_forward_the_record_does_not_cover_skips_the_step_on_every_rank():
    # Step 0: every rank skips block 1 (static, block 1 unused). Step 1: rank 1 uses it: not covered,
    # so no rank updates and the engine agrees again; step 2 (rank 1 still uses it) trains as agreed.
    skips = [(1, 1), (1, None), (1, None)]
    ref = _reference([(1, 1), None, (1, None)])
    for log, sd in run_distributed(2, _train, 2, skips):
        assert log == [(True, False), (False, True), (True, True)], log
        for k, v in ref.items():
            torch.testing.assert_close(sd[k], v, atol=1e-5, rtol=1e-5, msg=lambda m: f"{k}: {m}")


def _one_communicator(skips, backward_on):
    """ZeRO-3 on the native collectives (the GPU path: one communicator for gathers and gradients)."""
    import os

    os.environ["MEGAZERO_ZERO_COLLECTIVES"] = "native"
    try:
        engine = _engine(3)
    finally:
        del os.environ["MEGAZERO_ZERO_COLLECTIVES"]
    shared = engine.comm.groups["dp_grads"] is engine.comm.groups["dp"]
    rank = dist.get_rank()
    for step, skip in enumerate(skips):
        ids, labels = _data(step)
        loss = engine(ids[rank * 2:rank * 2 + 2], labels[rank * 2:rank * 2 + 2], skip[rank]).mean()
        if rank not in backward_on[step]:
            return shared, None
        try:
            engine.backward(loss)
        except RuntimeError as e:
            return shared, str(e)
        engine.step()
    return shared, None


def test_zero3_on_one_communicator_refuses_ranks_that_ran_different_layers():
    # Agreeing (step 0): both ranks learn from the same sum that rank 0 skipped block 1, and both refuse
    # before any backward collective.
    for shared, error in run_distributed(2, _one_communicator, [(1, None)], [(0, 1)]):
        assert shared  # no second communicator on the GPU path
        assert error is not None and "ran different layers" in error and "stage3_keep_gathered_in_step" in error
    # Static (step 1, after an equal step 0): rank 0 leaves the kept record and refuses at once; rank 1
    # (whose launcher would stop it) is not run into the backward here.
    results = run_distributed(2, _one_communicator, [(None, None), (1, None)], [(0, 1), (0,)])
    assert "ran different layers" in (results[0][1] or "") and results[1][1] is None


def _separate(stage):
    engine = _engine(stage)
    return engine.comm.groups["dp_grads"] is engine.comm.groups["dp"]


def test_a_second_gradient_communicator_only_on_the_emulated_gloo_path_at_zero3():
    assert run_distributed(2, _separate, 3) == [False, False]  # gloo: each kind keeps its own order
    assert run_distributed(2, _separate, 2) == [True, True]
