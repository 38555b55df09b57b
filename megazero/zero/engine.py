"""The ZeRO engine: stages 0-3 over the data-parallel group, composed with TP.

What each stage keeps per rank (Ψ = parameters of this rank's TP shard, N = DP size):

=====  ===========================  ==============================  ==========================
stage  compute-dtype parameters     gradients                       fp32 master + Adam moments
=====  ===========================  ==============================  ==========================
0      full (Ψ)                     full, all-reduced               full
1      full (Ψ)                     full, reduce-scattered at step  1/N
2      full (Ψ)                     1/N, reduce-scattered per unit  1/N
3      1/N, gathered per unit       1/N, reduce-scattered per unit  1/N
=====  ===========================  ==============================  ==========================

The engine mirrors DeepSpeed's: ``loss = engine(batch); engine.backward(loss);
engine.step()`` on every micro-batch; the optimizer steps on the last
micro-batch of each gradient-accumulation window. It never looks inside the
model beyond Megatron's parameter attributes (``tensor_model_parallel``), so
it trains any ``nn.Module`` built from mpu layers or plain torch layers.

A parameter that receives no gradient in a step is treated as having a zero
gradient (as in DeepSpeed): Adam leaves it alone but decoupled weight decay
still shrinks it, where ``torch.optim.AdamW`` would skip it entirely.
"""

from __future__ import annotations

import math
from typing import Callable, Optional

import torch
import torch.distributed as dist

from ..mpu.initializers import modules_with_direct_parameters
from ..mpu.sharding import full_from_shards, is_tp_sharded, shard_of_full
from .comm import CommCounter
from .config import ZeroConfig
from .flat import FlatGroup, ParamSlot
from .loss_scaler import LossScaler
from .units import Stage3Coordinator, Unit, find_unit_modules, release

__all__ = ["ZeroEngine"]

NoDecayFn = Callable[[str, torch.nn.Parameter], bool]


def _group_info(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class ZeroEngine(torch.nn.Module):
    """Wraps a model; owns its partitioned parameters, gradients and optimizer state."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ZeroConfig,
        *,
        dp_group: Optional[dist.ProcessGroup],
        tp_group: Optional[dist.ProcessGroup] = None,
        mp_group: Optional[dist.ProcessGroup] = None,
        no_weight_decay: Optional[NoDecayFn] = None,
        device: Optional[torch.device] = None,
        unit_modules: Optional[list[torch.nn.Module]] = None,
    ) -> None:
        super().__init__()
        self.module = model
        self.config = config
        self.stage = config.stage
        self.dp_size, self.dp_rank = _group_info(dp_group)
        self.tp_size, self.tp_rank = _group_info(tp_group)
        self.tp_group = tp_group
        config.check_batch(self.dp_size)
        self.comm = CommCounter({"dp": dp_group, "tp": tp_group, "mp": mp_group})
        self.compute_dtype = config.compute_dtype
        self.grad_dtype = config.grad_dtype
        self.accum = config.gradient_accumulation_steps
        first = next(model.parameters(), None)
        if device is None:
            device = first.device if first is not None and not first.is_meta else _default_device()
        self.device = torch.device(device)

        self.unit_modules = find_unit_modules(model) if unit_modules is None else list(unit_modules)
        self.units, self.root, self.groups = self._build_units(no_weight_decay or (lambda n, p: False))
        self._unit_of_group = {id(g): u for u in self.units for g in u.groups}
        self._slot_by_name = {s.name: (g, s) for g in self.groups for s in g.slots}
        self._materialize()
        self.grad_full = {}  # stage 0/1: full-size accumulated grads per group
        self.grad_shard = {}  # stage 1-3: this rank's reduced grad partition per group
        for g in self.groups:
            if self.stage <= 1:
                self.grad_full[g] = torch.zeros(g.padded_numel, dtype=self.grad_dtype, device=self.device)
            if self.stage == 1:  # the reduced partition lives in the full buffer's own slice
                self.grad_shard[g] = self.grad_full[g].narrow(0, g.shard_start, g.shard_numel)
            elif self.stage >= 2:
                self.grad_shard[g] = torch.zeros(g.shard_numel, dtype=self.grad_dtype, device=self.device)
        self.optimizer = self._build_optimizer()
        self.loss_scaler = LossScaler(config.fp16)

        self._in_backward = False
        self._reductions: list = []  # (work, unit, [(group, out)])
        self._hooks = [s.param.register_post_accumulate_grad_hook(self._grad_hook(g, s))
                       for g in self.groups for s in g.slots if s.param.requires_grad]
        self.coordinator = None
        if self.stage == 3:
            layer_units = self.units[: len(self.unit_modules)]
            self.coordinator = Stage3Coordinator(model, layer_units, self.unit_modules, self.root,
                                                 self._gather, self._grads_ready, lambda: self._in_backward)
        self.micro_steps = 0
        self.global_steps = 0
        self.skipped_steps = 0
        self.last_overflow = False
        self._global_grad_norm: Optional[float] = None

    # ------------------------------------------------------------------ construction

    def _build_units(self, no_decay: NoDecayFn) -> tuple[list[Unit], Optional[Unit], list[FlatGroup]]:
        model, stage = self.module, self.stage
        names = {}
        for name, p in model.named_parameters():
            names.setdefault(id(p), name)
        owner: dict[int, set[int]] = {}
        for i, m in enumerate(self.unit_modules):
            for p in m.parameters():
                owner.setdefault(id(p), set()).add(i)
        threshold = self.config.zero_optimization.stage3_param_persistence_threshold if stage == 3 else -1
        buckets: list[list[tuple[str, torch.nn.Parameter]]] = [[] for _ in self.unit_modules]
        root_params, persistent = [], []
        seen = set()
        for name, p in model.named_parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            if stage == 3 and p.numel() <= threshold:
                persistent.append((name, p))
            elif len(owner.get(id(p), ())) == 1:
                buckets[next(iter(owner[id(p)]))].append((name, p))
            else:
                root_params.append((name, p))

        partitions = 1 if stage == 0 else self.dp_size
        rank = 0 if stage == 0 else self.dp_rank

        def make(name: str, params, resident: bool) -> Unit:
            groups = []
            for decay in (True, False):
                chosen = [(n, p) for n, p in params if no_decay(n, p) != decay]
                if chosen:
                    groups.append(FlatGroup(chosen, partitions=partitions, rank=rank, compute_dtype=self.compute_dtype,
                                            device=self.device, resident=resident, weight_decay=decay))
            return Unit(name, groups)

        units = [make(f"unit{i}", b, resident=stage < 3) for i, b in enumerate(buckets)]
        root = make("root", root_params, resident=stage < 3) if root_params else None
        extra = [root] if root is not None else []
        if persistent:
            extra.append(make("persistent", persistent, resident=True))
        all_units = units + extra
        groups = [g for u in all_units for g in u.groups]
        self.slot_of: dict[int, tuple[FlatGroup, ParamSlot]] = {id(s.param): (g, s) for g in groups for s in g.slots}
        return all_units, root, groups

    @torch.no_grad()
    def _materialize(self) -> None:
        """Move parameter values into the flat groups.

        A model built on the meta device is initialized partition by partition: each
        rank draws only what it keeps, and the values equal a full tp=1 initialization
        (see :mod:`megazero.zero.materialize`).
        """
        from .materialize import materialize_partitions

        materialize_partitions(self.module, self.groups, self.slot_of, self.device)

    def _build_optimizer(self) -> torch.optim.Optimizer:
        oc = self.config.optimizer
        decay = [g.master for g in self.groups if g.weight_decay]
        no_decay = [g.master for g in self.groups if not g.weight_decay]
        param_groups = [{"params": decay, "weight_decay": oc.weight_decay}]
        if no_decay:
            param_groups.append({"params": no_decay, "weight_decay": 0.0})
        kwargs = dict(lr=oc.lr, betas=oc.betas, eps=oc.eps)
        if self.device.type == "cuda":
            try:  # apex's multi-tensor Adam, when NVIDIA apex is installed
                from apex.optimizers import FusedAdam

                return FusedAdam(param_groups, adam_w_mode=oc.adam_w_mode, **kwargs)
            except ImportError:
                kwargs["fused"] = True
        else:
            kwargs["foreach"] = True
        cls = torch.optim.AdamW if oc.adam_w_mode else torch.optim.Adam
        return cls(param_groups, **kwargs)

    # ------------------------------------------------------------------ gather / reduce

    def _gather(self, unit: Unit, async_op: bool) -> None:
        """All-gather a unit's partitions; ``async_op`` only starts it (a prefetch)."""
        if unit.gathered or (unit.pending and async_op):
            return
        if not unit.pending:
            for g in unit.groups:
                if not g.resident:
                    g.full = torch.empty(g.padded_numel, dtype=self.compute_dtype, device=self.device)
                    w = self.comm.all_gather(g.full, g.shard, "dp", async_op=async_op)
                    if w is not None:
                        unit.pending.append(w)
            if async_op and unit.pending:
                return
        for w in unit.pending:
            w.wait()
        unit.pending = []
        for g in unit.groups:
            if not g.resident:
                g.bind_views()
        unit.gathered = True

    def _grad_hook(self, group: FlatGroup, slot: ParamSlot):
        def hook(param: torch.Tensor) -> None:
            if self.stage <= 1:
                # Accumulate locally; communication waits for the accumulation boundary.
                self.grad_full[group].narrow(0, slot.offset, slot.numel).add_(param.grad.reshape(-1))
                param.grad = None
                return
            unit = self._unit_of_group[id(group)]
            unit.grads_seen += 1
            if unit.grads_seen == unit.grads_expected:
                self._grads_ready(unit)

        return hook

    def _grads_ready(self, unit: Unit) -> None:
        """Reduce-scatter a unit's gradients (stage 2/3) and, for ZeRO-3, release its parameters."""
        if unit.reduced:
            return
        unit.reduced = True
        overlap = self.config.zero_optimization.overlap_comm
        outs = []
        for g in unit.groups:
            full = g.flatten_grads(self.compute_dtype)  # reduced in the compute dtype, as DeepSpeed does
            for s in g.slots:
                s.param.grad = None
            out = torch.empty(g.shard_numel, dtype=full.dtype, device=self.device)
            w = self.comm.reduce_scatter(out, full, "dp", async_op=overlap)
            outs.append((g, out, full, w))
        self._reductions.append(outs)
        if self.stage == 3:
            release(unit)  # no-op for the persistent unit

    def _finish_reductions(self) -> None:
        for outs in self._reductions:
            for g, out, _full, w in outs:
                if w is not None:
                    w.wait()
                self.grad_shard[g].add_(out.to(self.grad_dtype))
        self._reductions = []

    # ------------------------------------------------------------------ training API

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of ``loss * loss_scale / gradient_accumulation_steps``."""
        scale = self.loss_scaler.scale / self.accum
        self._in_backward = True
        try:
            (loss * scale).backward()
        finally:
            self._in_backward = False
        if self.stage >= 2:
            for unit in self.units:
                if unit.used or unit.grads_seen or unit.resident:
                    # Units whose parameters got no gradient (unused) still owe a reduction.
                    if not unit.reduced and unit.grads_expected:
                        self._grads_ready(unit)
            self._finish_reductions()
            for unit in self.units:
                unit.grads_seen, unit.reduced, unit.used = 0, False, False
                if self.stage == 3 and not unit.resident:
                    release(unit)

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.accum == 0

    def step(self) -> bool:
        """Count a micro-batch; at the accumulation boundary update the parameters.

        Returns True when the parameters were updated (False inside an
        accumulation window, or when the step was skipped for inf/nan gradients).
        """
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return False
        self._reduce_at_boundary()
        grads = self._local_grads()
        overflow = self._has_overflow(grads)
        self.last_overflow = overflow
        updated = False
        if overflow:
            self.skipped_steps += 1
            self._global_grad_norm = float("nan")
        else:
            inv = 1.0 / (self.loss_scaler.scale * self.dp_size)
            norm = math.sqrt(self._sum_squares(grads)) * inv
            self._global_grad_norm = norm
            coef = inv
            clip = self.config.gradient_clipping
            if clip > 0 and norm > clip:
                coef *= clip / (norm + 1e-6)
            for g in self.groups:
                g.master.grad = grads[g].float().mul_(coef)
            self.optimizer.step()
            for g in self.groups:
                g.master.grad = None
            self._publish_params()
            updated = True
            self.global_steps += 1
        self.loss_scaler.update(overflow)
        self._zero_grads()
        return updated

    # ------------------------------------------------------------------ step internals

    def _reduce_at_boundary(self) -> None:
        if self.stage == 0:
            for g, buf in self.grad_full.items():
                self.comm.all_reduce(buf, "dp")
        elif self.stage == 1:
            for g, buf in self.grad_full.items():
                out = torch.empty_like(self.grad_shard[g])
                self.comm.reduce_scatter(out, buf, "dp")
                self.grad_shard[g].copy_(out)

    def _local_grads(self) -> dict[FlatGroup, torch.Tensor]:
        return dict(self.grad_full) if self.stage == 0 else dict(self.grad_shard)

    def _has_overflow(self, grads: dict[FlatGroup, torch.Tensor]) -> bool:
        bad = torch.zeros(1, device=self.device)
        for t in grads.values():
            if not torch.isfinite(t).all():
                bad.fill_(1.0)
                break
        self.comm.all_reduce(bad, "dp", op=dist.ReduceOp.MAX)
        self.comm.all_reduce(bad, "mp", op=dist.ReduceOp.MAX)
        return bool(bad.item())

    def _sum_squares(self, grads: dict[FlatGroup, torch.Tensor]) -> float:
        """Squared L2 norm of the whole model's gradient (still scaled), summed over DP and TP.

        Each element of the model is counted exactly once: DP partitions are
        disjoint, TP shards are disjoint, and TP-replicated parameters (norms,
        row-parallel biases) are counted on TP rank 0 only.
        """
        total = torch.zeros(1, dtype=torch.float64, device=self.device)
        for g, t in grads.items():
            for lo, hi in g.norm_ranges(count_replicated=self.tp_rank == 0, count_any=self.stage > 0 or self.dp_rank == 0):
                total += t[lo:hi].double().pow(2).sum()
        self.comm.all_reduce(total, "dp")
        self.comm.all_reduce(total, "mp")
        return float(total.item())

    @torch.no_grad()
    def _publish_params(self) -> None:
        """Copy the updated fp32 masters into the compute-dtype parameters."""
        for g in self.groups:
            if g.master is not g.shard:
                g.shard.copy_(g.master)
            if g.resident and g.partitions > 1:
                # Every rank updated its partition only: collect the others.
                self.comm.all_gather(g.full, g.shard.clone(), "dp")

    def _zero_grads(self) -> None:
        for buf in self.grad_full.values():
            buf.zero_()
        for buf in self.grad_shard.values():
            buf.zero_()

    # ------------------------------------------------------------------ reporting

    def get_global_grad_norm(self) -> Optional[float]:
        """Norm of the full model's gradient at the last step, as one process would compute it."""
        return self._global_grad_norm

    def get_loss_scale(self) -> float:
        return self.loss_scaler.scale

    def get_lr(self) -> list[float]:
        return [pg["lr"] for pg in self.optimizer.param_groups]

    def set_lr(self, lr: float) -> None:
        for pg in self.optimizer.param_groups:
            pg["lr"] = lr

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds: parameters, gradients, optimizer (master + moments)."""
        params = sum(g.full.numel() * g.full.element_size() if g.resident else g.shard.numel() * g.shard.element_size()
                     for g in self.groups)
        grad_buffers = self.grad_full if self.stage <= 1 else self.grad_shard  # stage 1's shards are views
        grads = sum(t.numel() * t.element_size() for t in grad_buffers.values())
        opt = sum(g.master.numel() * 4 for g in self.groups if g.master is not g.shard)
        for state in self.optimizer.state.values():
            opt += sum(v.numel() * v.element_size() for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        return {"params": params, "grads": grads, "optimizer": opt, "total": params + grads + opt}

    def num_local_parameters(self) -> int:
        """Ψ of the ZeRO formulas: parameters of this rank's TP shard."""
        return sum(g.numel for g in self.groups)

    # ------------------------------------------------------------------ full weights

    def tp_local(self, param: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
        """This rank's TP shard of ``full``, a tp=1-shaped value of ``param`` (or of its optimizer state)."""
        if not is_tp_sharded(param) or self.tp_size == 1:
            return full
        return shard_of_full(full, param.partition_dim, getattr(param, "partition_stride", 1), self.tp_rank, self.tp_size)

    @torch.no_grad()
    def load_full_weights(self, full: Callable[[str], torch.Tensor]) -> None:
        """Set every parameter (fp32 master and compute copy) from its full, tp=1-shaped value.

        ``full(name)`` returns the full tensor of parameter ``name``; each rank keeps its
        TP shard's DP partition. No communication. Raises ValueError on a shape mismatch.
        """
        for g in self.groups:
            for s in g.slots:
                value = full(s.name)
                local = self.tp_local(s.param, value)
                if tuple(local.shape) != tuple(s.shape):
                    raise ValueError(f"{s.name}: full shape {tuple(value.shape)} gives {tuple(local.shape)} on this rank, "
                                     f"the model has {tuple(s.shape)}; was the model configured differently?")
                g.load_param_values(s, local)
            if g.resident:
                g.bind_views()
        for unit in self.units:
            release(unit)  # drop gathered copies of the old values (no-op for resident units)

    @torch.no_grad()
    def full_master_tensors(self, which: str = "master") -> dict[str, torch.Tensor]:
        """Every parameter's value (fp32 master, or an Adam moment ``exp_avg``/``exp_avg_sq``)
        for this TP rank's shard, assembled over DP. Collective over the DP group."""
        out = {}
        for g in self.groups:
            local = g.master if which == "master" else self.optimizer.state.get(g.master, {}).get(which)
            if local is None:
                local = torch.zeros_like(g.master)
            full = torch.empty(g.padded_numel, dtype=torch.float32, device=self.device)
            if g.partitions > 1:
                self.comm.all_gather(full, local.float().contiguous(), "dp")
            else:
                full.copy_(local)
            out.update({k: v.clone() for k, v in g.unflatten(full).items()})
        return out

    @torch.no_grad()
    def consolidated_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Full, unsharded fp32 weights with the keys of a tp=1 model (collective).

        Returned on global rank 0 only unless ``rank0_only=False``.
        """
        local = self.full_master_tensors("master")
        out = {}
        for name, value in local.items():
            g, slot = self._slot_by_name[name]
            p = slot.param
            if is_tp_sharded(p) and self.tp_size > 1:
                parts = [torch.empty_like(value) for _ in range(self.tp_size)]
                dist.all_gather(parts, value.contiguous(), group=self.tp_group)
                value = full_from_shards(parts, p.partition_dim, getattr(p, "partition_stride", 1))
            out[name] = value.cpu()
        for name, b in self.module.named_buffers():
            out.setdefault(name, b.detach().cpu().clone())
        if rank0_only and dist.is_initialized() and dist.get_rank() != 0:
            return {}
        return out


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
