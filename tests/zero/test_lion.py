"""Lion (--optimizer lion, DeepSpeed's "Lion"), a component of one file: ZeRO-1 and ZeRO-3 at tp 2 x dp 2
equal the update written out below in plain torch on the whole model in one process."""

import pytest
import torch

from megazero.zero.config import ZeroConfigError, load_config
from tests.distributed import run_distributed
from tests.zero.common import LR, WD, reference_run, zero_run

BETAS = (0.9, 0.99)
LION = {"optimizer": {"type": "Lion", "params": {"lr": LR, "betas": list(BETAS), "weight_decay": WD}}}
STEPS = 4
# No biases: the key bias's gradient is zero in exact arithmetic (softmax ignores a shift shared by a row's
# logits), so its sign, all Lion keeps of it, is rounding noise that differs with the reduction order.
NO_BIAS = {"add_bias_linear": False}


def lion_step(model: torch.nn.Module):
    """Chen et al. 2023 with decoupled weight decay (lion-pytorch, optax), on every parameter."""
    momentum = {p: torch.zeros_like(p) for p in model.parameters()}
    beta1, beta2 = BETAS

    @torch.no_grad()
    def step():
        for p, m in momentum.items():
            g = p.grad
            p.mul_(1 - LR * WD)
            p.sub_(LR * torch.sign(beta1 * m + (1 - beta1) * g))
            m.copy_(beta2 * m + (1 - beta2) * g)

    return step


def _run(stage):
    import torch.distributed as dist

    losses, _, weights = zero_run(2, stage, steps=STEPS, extra=LION, model_overrides=NO_BIAS)
    return losses, weights if dist.get_rank() == 0 else None


@pytest.mark.parametrize("stage", [1, 3])
def test_lion_matches_the_formula_at_tp2_dp2(stage):
    ref_losses, _, ref_weights = reference_run(steps=STEPS, model_overrides=NO_BIAS, make_step=lion_step)
    losses, weights = run_distributed(4, _run, stage)[0]
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) <= 1e-6 * max(ref_losses)
    for k, v in ref_weights.items():
        torch.testing.assert_close(weights[k].float(), v, rtol=1e-6, atol=1e-6 * float(v.abs().max()), msg=k)
    assert max(ref_losses) - min(ref_losses) > 1e-3  # the steps moved the weights


def test_lion_config():
    oc = load_config({"optimizer": {"type": "lion", "params": {"lr": 1e-4}}}).optimizer
    assert oc.type == "Lion" and oc.betas == BETAS and oc.component.state_keys(oc) == ("exp_avg",)
    with pytest.raises(ZeroConfigError, match="unknown key optimizer.params.eps .*Lion takes lr, betas"):
        load_config({"optimizer": {"type": "Lion", "params": {"eps": 1e-8}}})
    with pytest.raises(ZeroConfigError, match=r"betas must be in \[0, 1\)"):
        load_config({"optimizer": {"type": "Lion", "params": {"betas": [0.9, 1.0]}}})
    with pytest.raises(ZeroConfigError, match="has no host step"):
        load_config({"optimizer": {"type": "Lion"}, "zero_optimization": {"stage": 1, "offload_optimizer":
                                                                         {"device": "cpu"}}})
