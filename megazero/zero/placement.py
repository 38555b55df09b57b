"""Where a ZeRO engine's state lives: the accelerator, host memory or NVMe.

The engine's :class:`Placement` member. It builds the optimizer over the trainable masters with ``offload_optimizer``'s groups on the host
(:mod:`megazero.zero.offload`) and ZeRO-3's ``offload_param`` (:mod:`megazero.zero.param_offload`),
routes the gathers' sources and the step's write-backs to wherever a partition lives, counts the
bytes of each place, and turns an offload I/O failure inside a step into a flag the next step's
all-reduce carries (a rank that raised there would leave its peers waiting in a collective).
"""

from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.distributed as dist

from .config import ZeroConfig
from .flat import FlatGroup
from .offload import OptimizerOffload, offloaded_groups
from .optim import build_optimizer, say_once
from .param_offload import ParamOffload

__all__ = ["Placement", "pick_device"]


class Placement:
    """The optimizer and the offloads of one engine's flat groups, and the routing between them.

    ``on_failure(what, error)`` is called for an offload I/O failure inside a step (the engine's
    ``fail_later``): the step's collectives must still happen on every rank."""

    def __init__(self, config: ZeroConfig, groups: list[FlatGroup], device: torch.device,
                 on_failure: Callable[[str, BaseException], None]) -> None:
        self.config, self.groups, self.device = config, groups, device
        self.trainable_groups = [g for g in groups if g.trainable]
        self.on_failure = on_failure
        self.optimizer = self._build_optimizer()
        self.param_offload = self._build_param_offload()

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the trainable masters: decayed and undecayed groups (kernel: optim.py).

        With ``offload_optimizer``, the offloaded groups' masters move to the host first
        (:mod:`megazero.zero.offload`); the optimizer still lists them, for one state dict and one
        set of hyperparameters, and its own step skips them (they carry no ``.grad``)."""
        oc = self.config.optimizer
        off = self.config.zero_optimization.offload_optimizer
        self.offload: Optional[OptimizerOffload] = None
        if off.enabled:
            self.offload = OptimizerOffload(offloaded_groups(self.trainable_groups, off.ratio), off, oc, self.device,
                                            rank=_rank(), say=say_once)
        self.offloaded = frozenset(self.offload.groups) if self.offload else frozenset()
        param_groups = self._param_groups(oc)
        return build_optimizer(param_groups, oc, self.device, mixed_devices=self.offload is not None)

    def _param_groups(self, oc) -> list[dict]:
        """Decayed and undecayed masters; a per-matrix optimizer's (Muon's) matrices in groups of their
        own (``per_matrix``), each kind at its lr (``lr_mult``: the LR schedule scales both alike)."""
        kinds = (False, True) if oc.component.per_matrix else (False,)
        groups = []
        for per_matrix in kinds:
            for decay in (True, False):
                masters = [g.master for g in self.trainable_groups
                           if g.weight_decay == decay and g.per_matrix == per_matrix]
                if not masters and not (decay and not per_matrix):  # the decayed group is always listed
                    continue
                group = {"params": masters, "weight_decay": oc.weight_decay if decay else 0.0}
                if oc.component.per_matrix:
                    lr = (oc.muon_lr if per_matrix else oc.adam_lr) or oc.lr
                    group.update(lr=lr, lr_mult=lr / oc.lr, per_matrix=per_matrix)
                groups.append(group)
        return groups

    def state_keys(self, g: Optional[FlatGroup] = None) -> tuple[str, ...]:
        """The optimizer state tensors kept beside ``g``'s master (its optimizer's component says
        which), or beside any master when ``g`` is None."""
        oc = self.config.optimizer
        if g is not None:
            return oc.component.state_keys(oc, g.per_matrix)
        keys: dict[str, None] = {}
        for group in self.trainable_groups:
            keys.update(dict.fromkeys(oc.component.state_keys(oc, group.per_matrix)))
        return tuple(keys)

    def _build_param_offload(self) -> Optional[ParamOffload]:
        """ZeRO-3's ``offload_param``: the gathered groups' partitions to the host or NVMe; the
        optimizer offload's write-back follows them."""
        cfg = self.config.zero_optimization.offload_param
        if not cfg.enabled or self.config.stage != 3:
            return None
        host_masters = self.offloaded \
            if self.offload is not None and not self.offload.nvme else frozenset()
        offload = ParamOffload(self.groups, cfg, self.device, rank=_rank(), masters_on_host=host_masters,
                               say=say_once)
        if self.offload is not None:
            self.offload.write_shard = self.write_shard
        return offload

    def is_offloaded(self, g: FlatGroup) -> bool:
        """Whether ``g``'s optimizer state (fp32 master, moments) lives on the host or NVMe."""
        return g in self.offloaded

    # ------------------------------------------------------------------ routing

    def gather_source(self, g: FlatGroup) -> torch.Tensor:
        """What ``g``'s all-gather sends. A read that fails (NVMe) sends zeros and flags the failure:
        the gather itself must still happen, or the other ranks would wait in it."""
        if not self.param_offload.owns(g):
            return g.fill_own_slice()
        try:
            return self.param_offload.source(g)
        except Exception as e:  # noqa: BLE001 - reported through the next step's all-reduce
            self.on_failure("reading the offloaded parameters", e)
            return g.own_slice().zero_()

    def write_shard(self, g: FlatGroup, lo: int, src: torch.Tensor) -> None:
        """Updated weights into ``g``'s compute-dtype partition at ``lo``, wherever it lives."""
        if self.param_offload is not None and self.param_offload.owns(g):
            try:
                self.param_offload.write(g, lo, src)
            except Exception as e:  # noqa: BLE001 - reported through the next step's all-reduce
                self.on_failure("writing the offloaded parameters", e)
        else:
            g.shard[lo:lo + src.numel()].copy_(src)

    def offloaded_step(self, grads: dict[FlatGroup, torch.Tensor], coef: float) -> None:
        """The host's part of the step, streamed; a failure there (an NVMe read or write) is flagged
        rather than raised: the step's collectives that follow still happen on every rank."""
        try:
            self.offload.step(self.optimizer, grads, coef)
        except Exception as e:  # noqa: BLE001 - reported through the next step's all-reduce
            self.on_failure("the offloaded optimizer step", e)

    def drop_pages(self) -> None:
        """Unmap the NVMe pages a whole-tensor access (checkpoint, load, logging) brought in."""
        for offload in (self.offload, self.param_offload):
            if offload is not None:
                offload.drop_pages()

    # ------------------------------------------------------------------ accounting

    def state_bytes(self, grads: int) -> dict[str, int]:
        """Bytes of model state this rank holds on its device: parameters, gradients, optimizer
        (master + moments), and ``total``; with offload also the host's apart: ``host_optimizer``
        (offloaded masters and moments in memory), ``host_ring`` (the step's buffers), ``nvme``
        (their files' size), ``host_params`` (offloaded parameter partitions in memory),
        ``host_param_ring`` (the NVMe reads' buffers) and ``nvme_params`` (the parameter files).
        ``grads``: the bytes of the gradient store's buffers."""
        po = self.param_offload
        params = sum(g.full.numel() * g.full.element_size() if g.resident else g.shard.numel() * g.shard.element_size()
                     for g in self.groups if po is None or not po.owns(g))
        opt = sum(g.master.numel() * 4 for g in self.groups if g.master is not g.shard and not self.is_offloaded(g))
        for g in self.trainable_groups:
            if not self.is_offloaded(g):
                opt += sum(v.numel() * v.element_size() for v in self.optimizer.state.get(g.master, {}).values()
                           if torch.is_tensor(v) and v.dim() > 0)
        out = {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}
        if self.offload is not None:
            out.update(self.offload.host_bytes(self.optimizer))
        if po is not None:
            out.update(po.host_bytes())
        return out

    def optimizer_state_buffers(self, group: FlatGroup, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint load writes ``group``'s optimizer state ``keys`` into: the
        optimizer's own, created (zero, beside the master) where absent; for an offloaded group its
        host tensors or NVMe maps. The step count is set apart (``optim.set_optimizer_step``)."""
        if not keys:
            return {}
        if self.is_offloaded(group):
            state = self.offload.init_state(self.optimizer, group)
        else:
            state = self.optimizer.state[group.master]
        for key in keys:
            if key not in state:
                state[key] = torch.zeros_like(group.master)
        return {key: state[key] for key in keys}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def pick_device(model: torch.nn.Module, device: Optional[torch.device]) -> torch.device:
    """``device``, else where the model's parameters are, else the current accelerator or the CPU."""
    if device is None:
        first = next(model.parameters(), None)
        if first is not None and not first.is_meta:
            device = first.device
        elif torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            device = torch.device("cpu")
    return torch.device(device)
