"""The figures a training step of the model reports, by name: the one place that spells them.

Each name is a 0-d float64 device tensor of one rank's stage, to be summed over the pipeline stages and
averaged over the data-parallel ranks when the log reduces them:

* ``lm loss``: the language-model loss (the last stage's mean micro-batch loss, 0 elsewhere);
* a mixture of experts': ``moe aux loss`` (the routers' auxiliary losses per micro-batch), ``expert load
  sum`` (each layer's busiest expert over the mean), ``moe layers`` (how many layers counted) and ``moe
  dropped sum`` (each layer's share of token copies over capacity);
* multi-token prediction's ``mtp_k loss`` at each depth ``k`` (its cross-entropy over its targets).
"""

from __future__ import annotations

import re
from typing import Sequence

import torch
import torch.distributed as dist

from .config import GPTConfig

__all__ = ["LM_LOSS", "MOE_AUX_LOSS", "EXPERT_LOAD_SUM", "MOE_LAYERS", "MOE_DROPPED_SUM", "MOE_METRICS",
           "mtp_loss_name", "is_mtp_loss", "metric_names", "step_metrics"]

LM_LOSS = "lm loss"
MOE_AUX_LOSS = "moe aux loss"
EXPERT_LOAD_SUM = "expert load sum"
MOE_LAYERS = "moe layers"
MOE_DROPPED_SUM = "moe dropped sum"
MOE_METRICS = (MOE_AUX_LOSS, EXPERT_LOAD_SUM, MOE_LAYERS, MOE_DROPPED_SUM)

_MTP_LOSS = re.compile(r"mtp_\d+ loss")


def mtp_loss_name(depth: int) -> str:
    """Multi-token prediction's loss at ``depth`` (1..D): ``'mtp_{depth} loss'`` (Megatron's name)."""
    return f"mtp_{depth} loss"


def is_mtp_loss(name: str) -> bool:
    """Whether ``name`` is :func:`mtp_loss_name` of some depth."""
    return _MTP_LOSS.fullmatch(name) is not None


def metric_names(config: GPTConfig) -> tuple[str, ...]:
    """The names a training step of ``config``'s model reports, in order, the same on every rank."""
    moe = MOE_METRICS if config.num_experts else ()
    return (LM_LOSS,) + moe + tuple(mtp_loss_name(k) for k in range(1, config.mtp_num_layers + 1))


def step_metrics(models: Sequence[torch.nn.Module], micro_batches: int,
                 device: torch.device) -> dict[str, torch.Tensor]:
    """The figures of a step's forwards through one stage's ``models`` (its chunks, ``GPTModel`` each), on
    ``device``: a mixture's :data:`MOE_METRICS` and multi-token prediction's :func:`mtp_loss_name` of each
    depth held here (see the module docstring). Reading them resets what the models recorded."""
    out: dict[str, torch.Tensor] = {}
    c = models[0].config
    if c.num_experts:
        aux, loads, dropped = [], [], []
        for m in models:
            a, l_, d = m.moe_aux.take()
            aux, loads, dropped = aux + a, loads + l_, dropped + d
        zero = torch.zeros((), dtype=torch.float64, device=device)
        total = (torch.stack(aux).sum().double() / micro_batches).to(device) if aux else zero
        if aux and models[0].sequence_parallel:  # each TP rank routed its own tokens: shares, one all-reduce
            dist.all_reduce(total, group=models[0].tp_group)
        out[MOE_AUX_LOSS] = total
        out[EXPERT_LOAD_SUM] = torch.stack(loads).sum().double().to(device) if loads else zero
        out[MOE_LAYERS] = torch.full((), float(len(loads)), dtype=torch.float64, device=device)
        out[MOE_DROPPED_SUM] = torch.stack(dropped).sum().double().to(device) if dropped else zero
    for m in models:
        records = m.mtp.take() if m.mtp is not None else []
        if records:
            for k, value in enumerate(torch.stack(records).sum(0)):
                out[mtp_loss_name(k + 1)] = value.double().to(device)
    return out
