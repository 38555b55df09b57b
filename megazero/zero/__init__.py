"""megazero.zero: ZeRO stages 0-3, each parameter over its own data-parallel group, composed with TP.

    engine = megazero.zero.initialize(model, ds_config, mpu=megazero.mpu)
    loss = engine(tokens, labels=labels).mean()
    engine.backward(loss)
    engine.step()

What each stage keeps per rank (Ψ = parameters of this rank's TP shard, N = the size of the
parameter's partitioning, ``partitioning.py``: the data-parallel group by default; for an expert,
the expert-data-parallel group):

=====  ===========================  ==============================  ==========================
stage  compute-dtype parameters     gradients                       fp32 master + Adam moments
=====  ===========================  ==============================  ==========================
0      full (Ψ)                     full, all-reduced               full
1      full (Ψ)                     full, reduce-scattered at step  1/N
2      full (Ψ)                     1/N, reduce-scattered per unit  1/N
3      1/N, gathered per unit       1/N, reduce-scattered per unit  1/N
=====  ===========================  ==============================  ==========================
"""

from __future__ import annotations

import os
from typing import Callable, Hashable, Optional, Union

import torch
import torch.distributed as dist

from .config import ZeroConfig, ZeroConfigError, load_config
from .engine import NoDecayFn, ZeroEngine
from .partitioning import PartitionFn, Partitioning

__all__ = ["initialize", "ZeroEngine", "ZeroConfig", "ZeroConfigError", "load_config", "Partitioning"]


def initialize(
    model: torch.nn.Module,
    config: Union[dict, str, os.PathLike, ZeroConfig],
    mpu=None,
    *,
    no_weight_decay: Optional[NoDecayFn] = None,
    device: Optional[torch.device] = None,
    unit_modules: Optional[list[torch.nn.Module]] = None,
    param_names: Optional[Callable[[str], str]] = None,
    forward_key: Optional[Callable[[tuple, dict], Hashable]] = None,
    partitioning: Optional[PartitionFn] = None,
    groups=None,
) -> ZeroEngine:
    """Wrap ``model`` in a :class:`ZeroEngine` configured by a DeepSpeed-schema dict or JSON path.

    ``mpu`` is any object with DeepSpeed's mpu contract (``megazero.mpu`` itself):
    partitions are taken over ``mpu.get_data_parallel_group()`` only (with context
    parallelism, Megatron's ``get_data_parallel_group(with_context_parallel=True)``: every
    context-parallel rank holds the same parameters), and the
    gradient norm is completed over ``mpu.get_model_parallel_group()``. Without
    ``mpu`` every rank is a data-parallel peer. A model built on the meta device
    is materialized partition by partition (ZeRO-3 never holds it whole).
    ``no_weight_decay(name, param)`` selects parameters trained without weight
    decay (Megatron excludes biases and norms). ``param_names`` maps a parameter's name
    in ``model`` to the name it is known by in the whole model (a pipeline stage's
    ``layers.0`` is the model's ``layers.8``): initial values are keyed by it and
    checkpoints list it, so every layout starts from the same weights. ``forward_key(args,
    kwargs)`` tells apart model calls that use different parameters on every rank alike (a
    pipeline stage's chunk index), so ZeRO-2/3 can stop agreeing on each forward
    (``megazero/zero/agreement.py``). ``partitioning(name, param)`` returns the
    :class:`Partitioning` a parameter is partitioned and reduced over instead of the
    data-parallel group (an expert over its expert-data-parallel group), or None. ``groups`` (a
    :class:`megazero.mpu.ParallelGroups`) hands the same groups directly, in place of ``mpu``.
    """
    cfg = load_config(config)
    tp_group = mp_group = samples = None
    if groups is not None and mpu is not None:
        raise ValueError("give zero.initialize the run's groups or an mpu, not both")
    if groups is not None:  # megazero's ParallelGroups: the same groups, handed instead of looked up
        samples, mp_group, tp_group = groups.dp_size, groups.mp_group, groups.tp_group
        dp_group = groups.dp_cp_group if groups.cp_size > 1 else groups.dp_group
    elif mpu is not None:
        samples = mpu.get_data_parallel_world_size()  # sample shards: context-parallel ranks share theirs
        dp_group = _data_parallel_group(mpu)
        mp_group = mpu.get_model_parallel_group()
        if hasattr(mpu, "get_tensor_model_parallel_group"):
            tp_group = mpu.get_tensor_model_parallel_group()
    else:
        dp_group = dist.group.WORLD if dist.is_initialized() else None
    return ZeroEngine(model, cfg, dp_group=dp_group, tp_group=tp_group, mp_group=mp_group,
                      no_weight_decay=no_weight_decay, device=device, unit_modules=unit_modules,
                      param_names=param_names, forward_key=forward_key, partitioning=partitioning,
                      data_parallel_size=samples)


def _data_parallel_group(mpu) -> Optional[dist.ProcessGroup]:
    """The ranks holding the same parameters: data x context parallel where ``mpu`` knows Megatron's
    ``with_context_parallel`` keyword, the data-parallel group otherwise (DeepSpeed's contract)."""
    try:
        return mpu.get_data_parallel_group(with_context_parallel=True)
    except TypeError:  # an mpu without context parallelism
        return mpu.get_data_parallel_group()
