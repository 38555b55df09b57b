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
