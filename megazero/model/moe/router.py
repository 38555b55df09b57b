"""The router of a mixture of experts (Megatron-core's TopKRouter): which experts each token goes to,
with what weights, which copies exceed capacity, and the auxiliary losses and statistics of routing.

On this rank's tokens ``[T, h]``, in fp32 (fp64 when asked): logits ``x W_r^T (+ b_r)`` ``[T, E]``, then
:func:`~.routing.route` (softmax or sigmoid scores, group-limited routing, the expert bias). The
load-balancing loss (Switch: E / (k T^2) sum_e P_e n_e, P_e the summed probabilities, n_e the copies
routed to e; per sequence with ``seq_aux_loss``) and the z-loss (mean logsumexp^2) are this rank's
share over the micro-batch (the TP ranks' shares add up under sequence parallelism); the layer attaches
them to its output with :meth:`Router.attach_losses`, so their gradients (scaled by
:class:`AuxLossScale`) arrive in backward without travelling with the activations. Capacity is decided
over the TP group's tokens, gathered over CP and put in one process's token order, so the same copies
drop at every layout. The loads, dropped shares and losses go to :class:`AuxLossScale` for the log.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu
from megazero.mpu.initializers import initialize_sharded_
from megazero.mpu.mappings import all_gather_first_dim

from ..attention.cp.context import ContextParallel
from ..attached_loss import attach_loss
from ..config import GPTConfig
from .routing import capacity_of, expert_counts, over_capacity, route

__all__ = ["AuxLossScale", "Router", "Routing"]


@dataclass
class AuxLossScale:
    """The factor the auxiliary losses' gradients get in backward: the training step sets it to what the
    language-model loss is scaled by (loss scale / micro-batches of the step). ``losses`` collects each
    MoE layer's auxiliary loss (this rank's share, detached) and ``loads`` its busiest expert's token
    copies over the mean, for the forwards since the last :meth:`take`, for the log."""

    value: Union[float, torch.Tensor] = 1.0
    losses: list = field(default_factory=list)
    loads: list = field(default_factory=list)
    dropped: list = field(default_factory=list)  # the share of token copies over capacity, per layer

    def take(self) -> tuple[list, list, list]:
        out = (self.losses, self.loads, self.dropped)
        self.losses, self.loads, self.dropped = [], [], []
        return out


@dataclass
class Routing:
    """One forward's routing of this rank's ``T`` tokens: ``top`` ``[T, k]`` the experts, ``weights``
    ``[T, k]`` theirs (router dtype), ``bias`` the expert bias used (None without), ``drop`` ``[T', k]``
    the copies over capacity among the rows the experts take here (None: dropless), ``slots`` the rows
    sent to each expert when padded to capacity (None: not padded), ``aux`` the losses' share (None: off)."""

    top: torch.Tensor
    weights: torch.Tensor
    bias: Optional[torch.Tensor]
    drop: Optional[torch.Tensor]
    slots: Optional[int]
    aux: Optional[torch.Tensor]


class Router(torch.nn.Module):
    """``[E, h]`` router weight (and ``[E]`` learned bias with ``moe_router_bias``), replicated over TP and EP,
    computed in fp32; the expert bias (fp32 buffers) when ``moe_router_enable_expert_bias``.
    ``tp_group``/``tp_size``: the layer's TP group (under sequence parallelism each rank routes its own
    tokens); ``own_tokens``: the experts take this rank's own tokens (expert TP other than TP), else the TP
    group's gathered ones; ``aux_scale``: where the losses' gradient scale is read and the statistics go."""

    def __init__(self, config: GPTConfig, init_method, device=None, *, tp_group: Optional[dist.ProcessGroup] = None,
                 tp_size: int = 1, own_tokens: bool = False, aux_scale: Optional[AuxLossScale] = None) -> None:
        super().__init__()
        self.config, self.init_method = config, init_method
        self.num_experts, self.hidden_size = config.num_experts, config.hidden_size
        self.tp_group, self.tp_size, self.own_tokens = tp_group, tp_size, own_tokens
        self.sequence_parallel = config.sequence_parallel and tp_size > 1
        self.tp_rank = mpu.utils.group_rank(tp_group) if tp_size > 1 else 0
        self.aux_scale = aux_scale if aux_scale is not None else AuxLossScale()
        self.weight = torch.nn.Parameter(torch.empty(config.num_experts, config.hidden_size,
                                                     dtype=config.params_dtype, device=device))
        self.bias = (torch.nn.Parameter(torch.empty(config.num_experts, dtype=config.params_dtype, device=device))
                     if config.moe_router_bias else None)
        if config.moe_router_enable_expert_bias:  # fp32 whatever the model's dtype; the bias is checkpointed
            self.register_buffer("expert_bias", torch.empty(config.num_experts, device=device))
            self.register_buffer("tokens_per_expert", torch.empty(config.num_experts, device=device), persistent=False)
        if device is None or torch.device(device).type != "meta":  # built for use, not for planning
            self.reset_parameters()

    def reset_parameters(self) -> None:
        initialize_sharded_(self.weight, (self.num_experts, self.hidden_size), 0, 0, 1, self.init_method)
        if self.bias is not None:  # megatron-core's: the weight's init method
            initialize_sharded_(self.bias, (self.num_experts,), 0, 0, 1, self.init_method)
        if hasattr(self, "expert_bias") and not self.weight.is_meta:
            self.place_buffers(self.weight.device)

    def place_buffers(self, device) -> None:
        """The expert bias and its counts as zeros on ``device``: a model built on the meta device gets
        its parameters from the ZeRO engine and these from here, before the engine binds it."""
        self.expert_bias = torch.zeros(self.num_experts, device=device)
        self.tokens_per_expert = torch.zeros(self.num_experts, device=device)

    @torch.no_grad()
    def update_expert_bias(self, counts: torch.Tensor, rate: float) -> None:
        """Move the bias by ``rate`` towards balance: up for the experts below the mean load of ``counts``
        (the step's token copies per expert over the whole batch), down for those above."""
        self.expert_bias.add_(rate * torch.sign(counts.mean() - counts))
        self.tokens_per_expert.zero_()

    def forward(self, tokens: torch.Tensor, batch: int, cp: Optional[ContextParallel] = None) -> Routing:
        """Route ``tokens`` ``[T, h]`` (``[s, b]`` flattened, ``batch`` = b); ``cp``: context parallelism over
        more than one rank, or None (the losses and capacity then count every part of the sequences)."""
        c = self.config
        w, b = self.weight, self.bias
        if self.sequence_parallel:  # each rank routes its own tokens: the weight's gradient is partial
            w = mpu.copy_to_tensor_model_parallel_region(w, self.tp_group)
            b = b if b is None else mpu.copy_to_tensor_model_parallel_region(b, self.tp_group)
        dtype = torch.float64 if c.moe_router_dtype == "fp64" else torch.float32
        logits = F.linear(tokens.to(dtype), w.to(dtype), b if b is None else b.to(dtype))
        bias = self.expert_bias if c.moe_router_enable_expert_bias else None
        top, weights, probs = route(logits, c.moe_router_topk, c.moe_router_pre_softmax, c.moe_router_score_function,
                                    c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor,
                                    bias)
        aux = self.losses(logits, probs, top, batch, cp.group if cp is not None else None)
        drop, slots = self._drops(top, weights, batch, cp), self._slots(top.size(0), cp)
        return Routing(top, weights, bias, drop, slots, aux)

    def attach_losses(self, y: torch.Tensor, routing: Routing) -> torch.Tensor:
        """``y`` itself, carrying ``routing``'s losses: backward gives them the gradient ``aux_scale.value``."""
        return attach_loss(y, routing.aux, self.aux_scale) if routing.aux is not None else y

    # ---- the auxiliary losses -------------------------------------------------------------------

    def losses(self, logits: torch.Tensor, probs: torch.Tensor, top: torch.Tensor, batch: int = 1,
               cp_group: Optional[dist.ProcessGroup] = None) -> Optional[torch.Tensor]:
        """This rank's share of the layer's load-balancing and z losses over the micro-batch's tokens
        (under SP the shares of the TP ranks add up to them); None when both are off. ``aux_loss`` is
        Switch's over the micro-batch; ``seq_aux_loss`` the same per sequence (DeepSeek-V2's), averaged
        over the micro-batch's ``batch`` sequences, so that any split of a global batch into micro-batches
        and data-parallel ranks gives the same loss."""
        c = self.config
        if not self.balancing and c.moe_z_loss_coeff <= 0:
            return None
        cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        tokens = logits.size(0) * (self.tp_size if self.sequence_parallel else 1) * cp
        total = logits.new_zeros(())
        if self.balancing:
            total = total + self._balancing_loss(probs, top, batch, tokens, cp_group)
        if c.moe_z_loss_coeff > 0:
            total = total + c.moe_z_loss_coeff * torch.logsumexp(logits, dim=-1).square().sum() / tokens
        if self.recording():
            self.aux_scale.losses.append(total.detach())
        return total

    def _balancing_loss(self, probs: torch.Tensor, top: torch.Tensor, batch: int, tokens: int,
                        cp_group: Optional[dist.ProcessGroup]) -> torch.Tensor:
        """The load-balancing loss's share of :meth:`losses` (``tokens``: the micro-batch's); it records
        the load over the whole micro-batch, which its counts are."""
        c = self.config
        e, k = c.num_experts, c.moe_router_topk
        if c.moe_router_load_balancing_type == "aux_loss":
            counts = expert_counts(top.reshape(-1), e).to(device=probs.device, dtype=probs.dtype)
            probs_sum, length = probs.sum(0), tokens
        else:  # tokens are [s, b] flattened: token t belongs to sequence t % b
            seq = (torch.arange(top.size(0), device=top.device) % batch).repeat_interleave(k)
            counts = torch.zeros(batch, e, dtype=probs.dtype, device=top.device)
            counts.index_put_((seq, top.reshape(-1)), torch.ones_like(seq, dtype=probs.dtype), accumulate=True)
            probs_sum, length = probs.view(-1, batch, e).sum(0), tokens // batch
        if self.sequence_parallel:
            dist.all_reduce(counts, group=self.tp_group)
        if cp_group is not None:  # the other parts of the sequences
            dist.all_reduce(counts, group=cp_group)
        if self.recording():
            whole = counts if counts.dim() == 1 else counts.sum(0)
            self.aux_scale.loads.append(whole.max() / whole.mean())
        scale = c.moe_aux_loss_coeff * e / (k * length * length)
        per_sequence = c.moe_router_load_balancing_type == "seq_aux_loss"
        return scale * (probs_sum * counts).sum() / (batch if per_sequence else 1)

    @property
    def balancing(self) -> bool:
        """Whether a load-balancing loss is on (it counts the loads over the whole micro-batch)."""
        c = self.config
        return c.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss") and c.moe_aux_loss_coeff > 0

    def recording(self) -> bool:
        """Whether this forward's figures go to the log: in training, once per micro-batch (under full
        recomputation the first, gradient-free pass is skipped; the recomputation records)."""
        return self.training and torch.is_grad_enabled()

    # ---- the loads, for the expert bias and the log ------------------------------------------------

    def count_for_bias(self, top: torch.Tensor) -> None:
        """Add the experts of ``top`` (the TP group's tokens) to the micro-batch's load the expert bias's
        update reads, when there is a bias and this forward records."""
        if self.config.moe_router_enable_expert_bias and self.recording():
            self.tokens_per_expert += expert_counts(top.reshape(-1), self.num_experts).to(top.device).float()

    def record_load(self, counts: torch.Tensor) -> None:
        """Log the busiest expert's copies over the mean of ``counts`` ``[E]``, without a load-balancing loss
        (which records the micro-batch's load itself)."""
        if self.recording() and not self.balancing:
            self.aux_scale.loads.append(counts.max().float() / counts.float().mean())

    def record_own_loads(self, top: torch.Tensor) -> None:
        """Expert TP other than TP: the load of the TP group's tokens (``top``: this rank's own, gathered
        here under SP) for the expert bias and the log, as one process counts it."""
        bias = self.config.moe_router_enable_expert_bias
        if not (self.recording() and (bias or not self.balancing)):
            return
        whole = all_gather_first_dim(top, self.tp_group) if self.sequence_parallel else top
        counts = expert_counts(whole.reshape(-1), self.num_experts).to(top.device)
        if bias:
            self.tokens_per_expert += counts.float()
        self.record_load(counts)

    # ---- capacity -----------------------------------------------------------------------------

    def _drops(self, top: torch.Tensor, weights: torch.Tensor, batch: int,
               cp: Optional[ContextParallel]) -> Optional[torch.Tensor]:
        """``[T, k]`` the copies over capacity among this rank's routed tokens (None without a capacity),
        returned for the rows the experts take here: the TP group's (gathered) tokens, or with ETP other
        than TP this rank's own. Decided over the whole micro-batch, gathered over TP and CP and put in one
        process's token order (sequence position x batch), so the same copies drop at every layout."""
        c = self.config
        if c.moe_expert_capacity_factor is None or top.device.type == "meta":
            return None
        k = top.size(1)
        rows = torch.cat([top.double(), weights.detach().double()], 1)  # exact: indices and fp32/fp64 weights
        if self.sequence_parallel:
            rows = all_gather_first_dim(rows, self.tp_group)
        if cp is None:
            drop = self._over_capacity(rows[:, :k].long(), rows[:, k:])
        else:
            index = _token_index(rows.size(0) // batch, batch, cp).double().unsqueeze(1)
            rows = all_gather_first_dim(torch.cat([rows, index], 1), cp.group)
            order = torch.argsort(rows[:, -1])
            kept = self._over_capacity(rows[order, :k].long(), rows[order, k:2 * k])
            drop = torch.empty_like(kept).index_copy_(0, order, kept)
            drop = drop.chunk(dist.get_world_size(cp.group))[dist.get_rank(cp.group)]
        if self.own_tokens and self.sequence_parallel:
            return drop.chunk(self.tp_size)[self.tp_rank]
        return drop

    def _slots(self, routed: int, cp: Optional[ContextParallel]) -> Optional[int]:
        """With padding to capacity: the rows this rank sends each expert, min(capacity, its tokens)
        (a rank cannot hold more of an expert's kept copies than either); None otherwise. ``routed``:
        the tokens this rank routed (its own under SP)."""
        c = self.config
        if not c.moe_pad_expert_input_to_capacity:
            return None
        whole = routed * (self.tp_size if self.sequence_parallel else 1)
        here = routed if self.own_tokens else whole  # the rows the experts take here
        micro_batch = whole * (dist.get_world_size(cp.group) if cp is not None else 1)
        capacity = capacity_of(micro_batch, c.moe_router_topk, c.num_experts, self._capacity_factor(),
                               c.moe_min_capacity)
        return min(capacity, here)

    def _capacity_factor(self) -> float:
        """The capacity factor of this pass: in evaluation the eval one where given."""
        c = self.config
        return c.moe_eval_capacity_factor if not self.training and c.moe_eval_capacity_factor else \
            c.moe_expert_capacity_factor

    def _over_capacity(self, top: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The token copies over their experts' capacity (:func:`over_capacity`), their share recorded."""
        c = self.config
        drop = over_capacity(top, weights, c.num_experts, self._capacity_factor(), c.moe_token_drop_policy,
                             c.moe_min_capacity)
        if self.recording():
            self.aux_scale.dropped.append(drop.float().mean())
        return drop


def _token_index(length: int, batch: int, cp: ContextParallel) -> torch.Tensor:
    """``[length * batch]`` one process's flat index (position x batch + sample) of this CP rank's
    tokens, held ``[length, batch]`` flattened."""
    if cp.sample_positions is not None:  # documents balanced per sample: each its own positions
        positions = cp.sample_positions.t()
    else:
        positions = cp.shard.positions.view(-1, 1).expand(length, batch)
    sample = torch.arange(batch, device=positions.device).view(1, -1)
    return (positions.to(sample.device) * batch + sample).reshape(-1)
