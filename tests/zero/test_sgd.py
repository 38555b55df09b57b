"""SGD with momentum (Megatron's --optimizer sgd): ZeRO-1 and ZeRO-3 at tp 2 x dp 2 equal one-process
torch.optim.SGD with coupled weight decay."""

import pytest
import torch

from megazero.model import GPTModel
from megazero.zero.config import ZeroConfigError, load_config
from tests.distributed import run_distributed
from tests.zero.common import GLOBAL_MICRO_ROWS, LR, SEED, WD, batches, tiny_config, zero_run

MOMENTUM = 0.9
SGD = {"optimizer": {"type": "SGD", "params": {"lr": LR * 30, "momentum": MOMENTUM, "weight_decay": WD}}}


def sgd_reference(steps=5):
    torch.manual_seed(SEED)
    model = GPTModel(tiny_config())
    opt = torch.optim.SGD(model.parameters(), lr=LR * 30, momentum=MOMENTUM, weight_decay=WD)
    data = batches(steps, 1, GLOBAL_MICRO_ROWS)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        rows = data[step, 0]
        loss = model(rows[:, :-1], labels=rows[:, 1:]).mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _run(stage):
    import torch.distributed as dist

    losses, _, weights = zero_run(2, stage, steps=5, extra=SGD)
    return losses, weights if dist.get_rank() == 0 else None


@pytest.mark.parametrize("stage", [1, 3])
def test_sgd_momentum_matches_torch_at_tp2_dp2(stage):
    ref_losses, ref_weights = sgd_reference()
    results = run_distributed(4, _run, stage)
    losses, weights = results[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5
    diff = max(float((weights[k].float() - v).abs().max()) for k, v in ref_weights.items())
    assert diff < 1e-5, diff
    assert max(ref_losses) - min(ref_losses) > 1e-3  # the steps moved the weights


def test_sgd_config():
    assert load_config(SGD).optimizer.momentum == MOMENTUM and load_config(SGD).optimizer.type == "SGD"
    with pytest.raises(ZeroConfigError, match=r"momentum must be in \[0, 1\)"):
        load_config({"optimizer": {"type": "sgd", "params": {"momentum": 1.5}}})
