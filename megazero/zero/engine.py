"""The ZeRO engine: stages 0-3 (what each keeps: ``megazero/zero/__init__.py``), composed with TP.

The engine mirrors DeepSpeed's: ``loss = engine(batch); engine.backward(loss);
engine.step()`` on every micro-batch; the optimizer steps on the last
micro-batch of each gradient-accumulation window. It never looks inside the
model beyond Megatron's parameter attributes (``tensor_model_parallel``), so
it trains any ``nn.Module`` built from mpu layers or plain torch layers.

The stage is a choice of strategies made once, in the constructor: a gradient
store (``grads.py``: full-size accumulation for 0-1, per-unit reduce-scatter for
2-3) and a parameter policy (resident for 0-2; ZeRO-3's gather window,
``window.py``). The pieces each live in their own file and own their state:
``flat.py`` (the flat, partitioned storage of a group of parameters and its
gradient buffers; a group gathers, releases and publishes itself and registers
its gradient hooks), ``units.py`` (which parameters go together; a unit gathers
and releases its groups), ``reducer.py`` (gradient buckets
reduce-scattered in a DP-agreed order), ``agreement.py`` (what each forward
used), ``optim.py`` (which optimizer kernel runs). This file wires them to the
optimizer step, loss scaling and the gradient norm.

Precision: bf16 runs accumulate and reduce gradients in fp32 (Megatron's
``main_grad``, DeepSpeed's bf16 optimizer); ``communication_data_type`` and
``data_types.grad_accum_dtype`` choose otherwise. fp16 keeps DeepSpeed's fp16
reduction under the dynamic loss scale.

Frozen parameters (``requires_grad=False``) are partitioned and gathered like
the others but never enter the optimizer: no gradient buffer, no weight decay.
A trainable parameter that receives no gradient in a step is treated as
having a zero gradient (as in DeepSpeed): Adam leaves it alone but decoupled
weight decay still shrinks it, where ``torch.optim.AdamW`` would skip it.
"""

from __future__ import annotations

import enum
import logging
import math
from typing import Callable, Hashable, Optional

import torch
import torch.distributed as dist

from ..utils.scopes import scope
from . import full_weights, materialize
from .agreement import STEP_VALUES
from .comm import build_comm
from .config import ZeroConfig
from .flat import FlatGroup, ParamSlot, squared_norm
from .grads import build_gradient_store
from .loss_scaler import LossScaler
from .optimizers import MatrixStep
from .partitioning import PartitionFn, Partitioning, check_within, data_parallel, group_info
from .placement import Placement, pick_device
from .reducer import GradReducer
from .units import Unit, UnitPlan, build_units, find_unit_modules, plan_units
from .window import refuse_differing_forwards, track_forwards

__all__ = ["ZeroEngine", "TrainingState"]

NoDecayFn = Callable[[str, torch.nn.Parameter], bool]
logger = logging.getLogger(__name__)


class TrainingState(enum.Enum):
    """Which pass the engine is in (read by the hooks: a forward inside backward is a recompute)."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"
    STEP = "step"


class ZeroEngine(torch.nn.Module):
    """Wraps a model; owns its partitioned parameters, gradients and optimizer state.

    ``partitioning(name, param)`` returns the :class:`Partitioning` a parameter is split and
    reduced over, or None for the data-parallel group (``dp_group``)."""

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
        param_names: Optional[Callable[[str], str]] = None,
        forward_key: Optional[Callable[[tuple, dict], Hashable]] = None,
        partitioning: Optional[PartitionFn] = None,
        data_parallel_size: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.module, self.config, self.stage = model, config, config.stage
        # The name each parameter is known by outside this module: what initialization keys its
        # values by and what checkpoints list. A pipeline stage maps its local names to the whole
        # model's (pp = 1) names, so the model is a function of the seed, not of the layout.
        self.param_name = param_names or (lambda n: n)
        self.dp_size, self.dp_rank = group_info(dp_group)
        # Ranks reading different samples: the gradients' divisor and DeepSpeed's batch invariant. It is
        # dp_size unless context parallelism splits each sample over several ranks of dp_group.
        self.data_parallel_size = data_parallel_size or self.dp_size
        self.tp_size, self.tp_rank = group_info(tp_group)
        self.tp_group = tp_group
        config.check_batch(self.data_parallel_size)
        self.compute_dtype = config.compute_dtype
        self.grad_dtype = config.grad_dtype  # accumulated gradient partitions
        self.reduce_dtype = config.reduce_dtype  # what the DP collectives carry
        self.accum = config.gradient_accumulation_steps
        self.device = pick_device(model, device)
        self.unit_modules = find_unit_modules(model) if unit_modules is None else list(unit_modules)
        # ZeRO-3 "keep gathered in step": gradients accumulate full-size, as in ZeRO-1, and are
        # reduce-scattered once at the accumulation boundary; gathered units live until the step.
        self.hold = self.stage == 3 and config.zero_optimization.stage3_keep_gathered_in_step
        self.units, self.groups, plan = self._build_units(no_weight_decay or (lambda n, p: False),
                                                          partitioning, data_parallel(dp_group))
        self.trainable_groups = [g for g in self.groups if g.trainable]
        self._slot_by_name = {s.name: (g, s) for g in self.groups for s in g.slots}
        for part in self.partitionings:
            check_within(part, dp_group, tp_group)
        self.comm = build_comm({"dp": dp_group, "tp": tp_group, "mp": mp_group}, self.partitionings,
                               stage=self.stage, keep_gathered=config.zero_optimization.stage3_keep_gathered_in_step)
        # A model built on the meta device is initialized partition by partition: each rank draws only
        # what it keeps, and the values equal a full tp=1 initialization (materialize.py).
        materialize.materialize_partitions(self.module, self.groups, self.slot_of, self.device)
        materialize.bind_parameters(self.module, self.groups, self.device)
        # DeepSpeed's prescale_gradients: divide by gradient_predivide_factor before the DP sum
        # (keeps fp16 sums in range), multiply back in the step.
        self._predivide = config.gradient_predivide_factor if config.prescale_gradients else 1.0
        self.grads = build_gradient_store(self.stage, self.hold, config.zero_optimization, self.trainable_groups,
                                          self.comm, self.units, grad_dtype=self.grad_dtype,
                                          reduce_dtype=self.reduce_dtype, device=self.device, predivide=self._predivide)
        self.placement = Placement(config, self.groups, self.device, on_failure=self.fail_later)
        self.matrix_step = self._build_matrix_step(tp_group)
        self.loss_scaler = LossScaler(config.fp16)
        self.state = TrainingState.IDLE
        self._hooks = [h for g in self.trainable_groups for h in g.register_grad_hooks(self.grads.on_grad)]
        self.agreement, self.window, self._usage_hooks = track_forwards(
            self.module, self.units, plan, self.comm, stage=self.stage, dp_size=self.dp_size, device=self.device,
            forward_key=forward_key, in_backward=self._in_backward, hold=self.hold, zc=config.zero_optimization,
            source=self.placement.gather_source if self.param_offload is not None else None)
        self.failed_ranks = 0  # ranks that flagged a failure into the last step (flag_failure)
        self.deferred_failure: Optional[tuple[str, BaseException]] = None  # this rank's first (fail_later)
        self._failed_here = False
        self.micro_steps = self.global_steps = self.skipped_steps = 0
        self.last_overflow = False
        self._global_grad_norm: Optional[float] = None
        # Called with the engine when the optimizer is about to step: the elementwise groups' unscaled,
        # clipped gradients are their masters' .grad, an offloaded group's is its grad_shard
        # (--log-num-zeros-in-grad counts them there: megazero/training/norms.py).
        self.before_update: list[Callable[["ZeroEngine"], None]] = []
        # Called with the engine after each update of the fp32 masters, before the weights are published
        # from them (QK-clip rescales rows there: megazero/training/qk_clip.py).
        self.after_update: list[Callable[["ZeroEngine"], None]] = []

    # ------------------------------------------------------------------ construction

    def _build_units(self, no_decay: NoDecayFn, partitioning: Optional[PartitionFn],
                     default: Partitioning) -> tuple[list[Unit], list[FlatGroup], UnitPlan]:
        """Units in static order, each split into flat groups by partitioning and optimizer class."""
        threshold = self.config.zero_optimization.stage3_param_persistence_threshold if self.stage == 3 else -1
        plan = plan_units(self.module, self.unit_modules, threshold)
        oc = self.config.optimizer
        per_matrix = (lambda n, p, in_layer: oc.component.takes_matrix(p, in_layer, n)) if oc.component.per_matrix \
            else None
        units, self.partitionings = build_units(
            plan, stage=self.stage, no_decay=no_decay, partitioning=partitioning, default=default,
            param_name=self.param_name, compute_dtype=self.compute_dtype, device=self.device, per_matrix=per_matrix)
        groups = [g for u in units for g in u.groups]
        self.slot_of: dict[torch.nn.Parameter, tuple[FlatGroup, ParamSlot]] = {
            s.param: (g, s) for g in groups for s in g.slots}
        return units, groups, plan

    def _build_matrix_step(self, tp_group) -> Optional[MatrixStep]:
        """The optimizer component's per-matrix update (Muon's: ``muon.py``) of the groups it updates as
        whole matrices; None when there are none (an elementwise optimizer)."""
        groups = [g for g in self.trainable_groups if g.per_matrix]
        if not groups:
            return None
        oc = self.config.optimizer
        return oc.component.matrix_step(groups, oc, self.comm, tp_group, self.tp_rank, self.tp_size)

    def state_keys(self, g: Optional[FlatGroup] = None) -> tuple[str, ...]:
        """The optimizer state tensors beside ``g``'s master (any master's when None): what
        checkpoints save and reshard (``Placement.state_keys``)."""
        return self.placement.state_keys(g)

    def _in_backward(self) -> bool:
        return self.state is TrainingState.BACKWARD

    # ------------------------------------------------------------------ views kept for callers

    @property
    def reducer(self) -> Optional[GradReducer]:
        """ZeRO-2/3's gradient reducer (None for the full-size stores)."""
        return getattr(self.grads, "reducer", None)

    @property
    def grad_shard(self) -> dict[FlatGroup, torch.Tensor]:
        return {g: g.grad_shard for g in self.trainable_groups if g.grad_shard is not None}

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The optimizer over the trainable fp32 masters (kept by the placement, which routes its state)."""
        return self.placement.optimizer

    @optimizer.setter
    def optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.placement.optimizer = optimizer

    @property
    def offload(self):
        """The optimizer offload (``placement.py``), or None."""
        return self.placement.offload

    @property
    def param_offload(self):
        """ZeRO-3's parameter offload (``placement.py``), or None."""
        return self.placement.param_offload

    def is_offloaded(self, g: FlatGroup) -> bool:
        """Whether ``g``'s optimizer state lives on the host or NVMe."""
        return self.placement.is_offloaded(g)

    def model_state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds, by kind and place (``Placement.state_bytes``)."""
        return self.placement.state_bytes(self.grads.nbytes())

    def optimizer_state_buffers(self, group: FlatGroup, keys: tuple[str, ...]) -> dict[str, torch.Tensor]:
        """Where a checkpoint load writes ``group``'s optimizer state (``Placement.optimizer_state_buffers``)."""
        return self.placement.optimizer_state_buffers(group, keys)

    def drop_pages(self) -> None:
        """Unmap the NVMe pages a whole-tensor access brought in."""
        self.placement.drop_pages()

    def load_full_weights(self, full: Callable[[str], torch.Tensor]) -> None:
        """Set every parameter from its full, tp=1-shaped value ``full(name)`` (no communication)."""
        full_weights.load_full_weights(self, full)

    def full_master_tensors(self, which: str = "master") -> dict[str, torch.Tensor]:
        """This TP rank's fp32 masters (or an Adam moment) by name, assembled over each partitioning."""
        return full_weights.full_master_tensors(self, which)

    def consolidated_state_dict(self, rank0_only: bool = True) -> dict[str, torch.Tensor]:
        """Full fp32 weights with the keys of a tp=1 model (collective; rank 0 only unless told)."""
        return full_weights.consolidated_state_dict(self, rank0_only)

    # ------------------------------------------------------------------ training API

    def forward(self, *args, **kwargs):
        self.state = TrainingState.FORWARD
        try:
            return self.module(*args, **kwargs)
        finally:
            self.state = TrainingState.IDLE

    def backward(self, loss: torch.Tensor, output_grad: Optional[torch.Tensor] = None) -> None:
        """Backward of ``loss * loss_scale / gradient_accumulation_steps``.

        With ``output_grad`` (a pipeline stage that is not the last), ``loss`` is the
        stage's output and the gradient arriving from the next stage is used as is:
        it already carries the scaling.
        """
        if self.agreement is not None:
            rec = self.agreement.for_backward(loss)
            if not rec.uniform and self.window is not None and self.reducer is not None:
                refuse_differing_forwards(self.comm, self.partitionings)
            self.grads.begin_backward(rec)
            if self.window is not None:
                self.window.begin_backward(rec.trace, rec.saved)
        self.state = TrainingState.BACKWARD
        try:
            if output_grad is None:
                (loss * (self.loss_scaler.scale / self.accum)).backward()
            else:
                torch.autograd.backward(loss, output_grad)
        finally:
            self.state = TrainingState.IDLE
            if self.window is not None:
                self.window.end_backward()
        self.grads.end_backward()

    @torch.no_grad()
    def accumulate_grad_(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad`` (already carrying the loss scale) to ``param``'s gradient for this step.

        For gradients that arrive outside autograd, such as a tied embedding's contribution
        from another pipeline stage. Call it after the step's backwards and before
        :meth:`step`; every DP peer must call it for the same parameters (ZeRO-2/3 reduce
        the parameter's group once more).
        """
        g, slot = self.slot_of[param]
        if not g.trainable:
            raise ValueError(f"{slot.name} is frozen (requires_grad=False): it has no gradient to add to")
        if tuple(grad.shape) != tuple(slot.shape):
            raise ValueError(f"{slot.name}: gradient of shape {tuple(grad.shape)} for a parameter of shape {tuple(slot.shape)}")
        self.grads.add(g, slot, grad)

    def set_gradient_accumulation_steps(self, steps: int) -> None:
        """Change the micro-batches per step (batch-size ramp-up). Only between steps."""
        if self.micro_steps % self.accum:
            raise RuntimeError(f"set_gradient_accumulation_steps({steps}) inside an accumulation window "
                               f"({self.micro_steps % self.accum} of {self.accum} micro-batches done)")
        if steps < 1:
            raise ValueError(f"gradient accumulation steps must be >= 1, got {steps}")
        self.accum, self.micro_steps = steps, 0

    def is_gradient_accumulation_boundary(self) -> bool:
        return (self.micro_steps + 1) % self.accum == 0

    def step(self) -> bool:
        """Count a micro-batch; at the accumulation boundary update the parameters.

        Returns True when the parameters were updated (False inside an
        accumulation window, or when the step was skipped: inf/nan gradients, a rank that
        flagged a failure (``failed_ranks``), or DP ranks whose forwards differed unnoticed).
        """
        boundary = self.is_gradient_accumulation_boundary()
        self.micro_steps += 1
        if not boundary:
            return False
        self.state = TrainingState.STEP
        try:
            with scope("zero.step"):
                return self._step()
        finally:
            self.state = TrainingState.IDLE

    def _step(self) -> bool:
        """The update at an accumulation boundary (see :meth:`step`)."""
        self.grads.reduce()
        grads = self._local_grads()
        # One pair of all-reduces gives the norm, the overflow check (an inf or nan anywhere makes
        # the global sum of squares non-finite, as in Megatron and DeepSpeed), the failure flags
        # and the forward agreement's check: the step's one host synchronisation.
        sum_sq, failed, forwards_differed = self._step_sums(grads)
        self.failed_ranks = failed
        overflow = not math.isfinite(sum_sq)
        self.last_overflow = overflow and not failed
        updated = False
        if failed or forwards_differed:
            self._global_grad_norm = float("nan")
            if forwards_differed and self.dp_rank == 0 and self.tp_rank == 0:
                logger.warning("the data-parallel ranks ran different forwards in this step without agreeing on "
                               "them (their control flow depends on the data); the update was skipped and the "
                               "engine agrees on every forward from now on (one host synchronisation per "
                               "micro-batch)")
        elif overflow:
            self.skipped_steps += 1
            self._global_grad_norm = float("nan")
        else:
            inv = self._predivide / (self.loss_scaler.scale * self.data_parallel_size)
            norm = math.sqrt(sum_sq) * inv
            self._global_grad_norm = norm
            coef = inv
            clip = self.config.gradient_clipping
            if clip > 0 and norm > clip:
                coef *= clip / (norm + 1e-6)
            on_device = [g for g in self.trainable_groups if not self.placement.is_offloaded(g) and not g.per_matrix]
            for g in on_device:
                g.master.grad = grads[g].float().mul_(coef)
            for hook in self.before_update:
                hook(self)
            self.optimizer.step()  # elementwise groups (per-matrix ones carry no .grad: the kernel skips them)
            for g in on_device:
                g.master.grad = None
            if self.matrix_step is not None:  # whole matrices, each updated once by its owner
                self.matrix_step.step(grads, coef, self.optimizer)
            if self.offload is not None:  # the host's part, streamed (its return writes each shard)
                self.placement.offloaded_step(grads, coef)
            for hook in self.after_update:
                hook(self)
            self._publish_params(written=self.placement.offloaded)
            updated = True
            self.global_steps += 1
        if not (failed or forwards_differed):
            self.loss_scaler.update(overflow)
        self._zero_grads()
        if self.window is not None:
            self.window.end_step()
        return updated

    # ------------------------------------------------------------------ step internals

    def _local_grads(self) -> dict[FlatGroup, torch.Tensor]:
        """Each trainable group's reduced gradient on this rank (its partition, or the whole at ZeRO-0)."""
        return {g: self.grads.local(g) for g in self.trainable_groups}

    def fail_later(self, what: str, error: BaseException) -> None:
        """This rank failed inside a sequence of collectives (``what``): it goes on with them, the
        next step's all-reduce carries the flag, no rank updates its parameters, every rank sees
        ``failed_ranks > 0``, and the trainer concludes with :attr:`deferred_failure` (the first)."""
        self.flag_failure()
        if self.deferred_failure is None:
            self.deferred_failure = (what, error)

    def flag_failure(self) -> None:
        """This rank failed outside the step (a bad sample read): the next step's all-reduce carries
        the flag, no rank updates its parameters, and every rank sees ``failed_ranks > 0`` — so
        the ranks can stop together without a collective of their own per iteration."""
        self._failed_here = True

    def _step_sums(self, grads: dict[FlatGroup, torch.Tensor]) -> tuple[float, int, bool]:
        """``(squared norm, ranks that flagged a failure, forwards differed unnoticed)``: one
        all-reduce over DP, one over the model-parallel group, one read to the host."""
        extra = self.agreement.step_values() if self.agreement is not None else [0.0] * STEP_VALUES
        values = torch.zeros(2 + STEP_VALUES, dtype=torch.float64, device=self.device)
        values[0] = self._sum_squares(grads)
        for i, v in enumerate([1.0 if self._failed_here else 0.0] + extra):
            if v:
                values[1 + i].fill_(v)  # a kernel with a scalar argument: no host-to-device copy
        self._failed_here = False
        self.comm.all_reduce(values, "dp")
        self.comm.all_reduce(values, "mp")
        sum_sq, failed, unsettled = values.tolist()
        differs = self.agreement.settle(unsettled) if self.agreement is not None else False
        return sum_sq, int(failed), differs

    def _sum_squares(self, grads: dict[FlatGroup, torch.Tensor]) -> torch.Tensor:
        """Squared L2 norm of this rank's part of the model's gradient (``flat.squared_norm``)."""
        return squared_norm(grads, tp_rank=self.tp_rank, device=self.device)

    @torch.no_grad()
    def scale_rows(self, param: torch.nn.Parameter, factors: torch.Tensor) -> None:
        """Multiply row ``r`` of ``param`` (this rank's TP shard, 2-D) by ``factors[r]`` in the fp32 master
        partition this rank holds; the weights follow at the next publication (an ``after_update`` hook's
        change is published by the step that called it). The optimizer state is left as it is."""
        g, slot = self.slot_of[param]
        if self.is_offloaded(g):
            raise ValueError(f"{slot.name}: its fp32 master is offloaded; rows cannot be rescaled on the device")
        g.scale_rows(slot, factors)

    @torch.no_grad()
    def publish_params(self) -> None:
        """After values were written into the fp32 masters (a checkpoint load): refresh every
        group's compute-dtype copy, frozen ones included, and drop gathered ZeRO-3 copies."""
        self._publish_params(self.groups)
        self.release_gathered()
        self.drop_pages()

    def release_gathered(self) -> None:
        """Free every gathered ZeRO-3 unit (their values may be stale)."""
        if self.window is not None:
            self.window.release_all(force=True)

    @torch.no_grad()
    def _publish_params(self, groups: Optional[list[FlatGroup]] = None, written: frozenset = frozenset()) -> None:
        """Copy the updated fp32 masters into the compute-dtype parameters (except the groups in
        ``written``: the offloaded step already wrote their shards)."""
        write_shard, all_gather = self.placement.write_shard, self.comm.all_gather
        for g in self.trainable_groups if groups is None else groups:
            g.publish(write_shard, all_gather, written=g in written)

    def _zero_grads(self) -> None:
        self.grads.zero()

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
            pg["lr"] = lr * pg.get("lr_mult", 1.0)

    def num_local_parameters(self) -> int:
        """Ψ of the ZeRO formulas: parameters of this rank's TP shard."""
        return sum(g.numel for g in self.groups)
