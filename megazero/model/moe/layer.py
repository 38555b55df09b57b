"""Mixture of experts (Megatron-core's MoELayer): a top-k router, experts sharded over the
expert-parallel (EP) ranks, and a dropless dispatch by all-to-all.

Per layer, on this rank's tokens ``[s(/tp), b, h]``:

1. **Route** in fp32: logits ``x W_r^T`` ``[T, E]``; the top k experts of each token by logit, ties
   broken by the lower expert index; their weights ``softmax`` over the k chosen logits (Mixtral,
   Megatron's default) or, with ``moe_router_pre_softmax``, the softmax over all experts at the chosen
   ones (Qwen2-MoE's, not renormalised). The load-balancing loss (Switch: E / (k T^2) sum_e P_e n_e,
   P_e the summed probabilities, n_e the tokens routed to e) and the z-loss (mean logsumexp^2) add
   their gradients in backward (:class:`AuxLossScale`), not to the returned activations.
2. **Dispatch**: each token copy goes to the rank holding its expert (experts ``r*E/ep ..`` on EP rank
   ``r``) by one uneven all-to-all; the rows an expert receives are ordered by (source rank, token),
   which is one process's token order, so the expert's matmuls see the same rows at any EP.
3. **Experts**: SwiGLU/GeLU MLPs, one module per expert named by its global index (so initial weights
   and checkpoints do not depend on EP), each sharded over the expert tensor-parallel (ETP) group,
   TP by default. Their outputs are partial sums over ETP.
4. **Combine**: the reverse all-to-all, then each token's k outputs weighted and summed.

With ETP = TP, under sequence parallelism the router runs on the rank's own tokens (its weight's
gradient summed over TP), and tokens and routing are all-gathered over TP before the dispatch; the
experts' partial outputs are reduced (scattered) over TP once. With ETP other than TP (Megatron-core's
``--expert-tensor-parallel-size``, e.g. whole experts under TP 2), each rank routes and sends only its
own tokens, to every ETP rank of their expert, over the etp x ep group; the partial outputs come back
and are summed on the token's rank. Capacity and the logged loads are decided over the TP group's
tokens either way. Dropless: every token reaches its k experts (the rows an expert gets vary, and
reading the all-to-all's splits waits for the device once per layer and micro-batch).
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

from ..config import GPTConfig
from ..attention.cp_context import ContextParallel
from .grouped_linear import group_offsets, grouped_linear, grouped_matmul_available
from .dispatch import TokenDispatcher, padded_slots
from .routing import capacity_of, over_capacity, route

__all__ = ["AuxLossScale", "Router", "MoELayer", "is_moe_layer", "is_expert_parameter", "route", "over_capacity"]


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


class _WithAuxGrad(torch.autograd.Function):
    """Identity on ``x``; backward also gives ``aux`` the gradient ``scale.value`` (Megatron's
    MoEAuxLossAutoScaler): the loss takes effect without travelling with the activations."""

    @staticmethod
    def forward(ctx, x, aux, scale):
        ctx.scale, ctx.aux_dtype = scale, aux.dtype
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        value = ctx.scale.value
        return grad, torch.ones((), dtype=ctx.aux_dtype, device=grad.device) * value, None


def is_moe_layer(config: GPTConfig, number: int) -> bool:
    """Layer ``number`` (its index in the whole model) is a mixture of experts."""
    return config.is_moe_layer(number)


def is_expert_parameter(name: str) -> bool:
    """A routed expert's weight, by its name (``...mlp.experts.<e>....``): ZeRO partitions these over
    the expert-data-parallel ranks."""
    return ".mlp.experts." in f".{name}"


class Router(torch.nn.Module):
    """``[E, h]`` router weight, replicated over TP and EP, computed in fp32."""

    def __init__(self, config: GPTConfig, init_method, device=None) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.init_method = config.num_experts, config.hidden_size, init_method
        self.weight = torch.nn.Parameter(torch.empty(config.num_experts, config.hidden_size,
                                                     dtype=config.params_dtype, device=device))
        if config.moe_router_enable_expert_bias:  # fp32 whatever the model's dtype; the bias is checkpointed
            self.register_buffer("expert_bias", torch.empty(config.num_experts, device=device))
            self.register_buffer("tokens_per_expert", torch.empty(config.num_experts, device=device), persistent=False)
        if device is None or torch.device(device).type != "meta":  # built for use, not for planning
            self.reset_parameters()

    def reset_parameters(self) -> None:
        initialize_sharded_(self.weight, (self.num_experts, self.hidden_size), 0, 0, 1, self.init_method)
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


class SharedGate(torch.nn.Module):
    """The shared expert's gate ``sigmoid(x w)``, ``w`` ``[1, h]`` replicated over TP. It scales the
    expert's partial (per TP rank) output, so its weight's gradient is partial too: summed over TP."""

    def __init__(self, config: GPTConfig, init_method, device=None) -> None:
        super().__init__()
        self.hidden_size, self.init_method = config.hidden_size, init_method
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype, device=device))
        if device is None or torch.device(device).type != "meta":
            self.reset_parameters()

    def reset_parameters(self) -> None:
        initialize_sharded_(self.weight, (1, self.hidden_size), 0, 0, 1, self.init_method)

    def forward(self, tokens: torch.Tensor, tp_group) -> torch.Tensor:
        w = self.weight if tp_group is None else mpu.copy_to_tensor_model_parallel_region(self.weight, tp_group)
        return torch.sigmoid(F.linear(tokens, w))


def _counts(flat: torch.Tensor, experts: int) -> torch.Tensor:
    """Token copies per expert ``[E]``. On the meta device (a rehearsal) the routing is unknown: the
    counts are taken uniform, the typical load a balanced router reaches."""
    if flat.device.type != "meta":
        return torch.bincount(flat, minlength=experts)
    base, extra = divmod(flat.numel(), experts)
    return torch.tensor([base + (e < extra) for e in range(experts)], dtype=torch.long)


class MoELayer(torch.nn.Module):
    """The MLP of a mixture-of-experts layer: ``[s(/tp), b, h]`` -> the same shape (see the module).

    ``expert`` builds one expert (an MLP sharded over the expert tensor-parallel group whose
    ``partial(x)`` skips its reduction); this rank holds experts ``ep_rank * E/ep .. (ep_rank+1) * E/ep - 1``
    of ``ep_group``. Expert tensor parallelism (``etp_*``) defaults to TP; when it differs,
    ``exchange_group`` is the etp x ep group (Megatron-core's expert tensor and model parallel group)
    the tokens travel over, and each rank routes its own tokens (sequence parallelism when tp > 1)."""

    def __init__(self, config: GPTConfig, expert, *, tp_group: Optional[dist.ProcessGroup], tp_size: int,
                 ep_group: Optional[dist.ProcessGroup], ep_size: int, ep_rank: int, aux_scale: AuxLossScale,
                 init_method, device=None, shared=None, etp_group=None, etp_size: Optional[int] = None,
                 etp_rank: int = 0, exchange_group: Optional[dist.ProcessGroup] = None) -> None:
        super().__init__()
        c = config
        if c.num_experts % ep_size:
            raise ValueError(f"{c.num_experts} experts are not divisible by the expert-parallel size {ep_size}")
        self.config, self.tp_group, self.tp_size = c, tp_group, tp_size
        self.ep_group, self.ep_size, self.aux_scale = ep_group, ep_size, aux_scale
        self.sequence_parallel = c.sequence_parallel and tp_size > 1
        self.tp_rank = mpu.utils.group_rank(tp_group) if tp_size > 1 else 0
        etp_size = tp_size if etp_size is None else etp_size
        # Each rank routes its own tokens and sends each copy to every etp rank of its expert; else the
        # tokens are gathered over TP (= etp) first and each TP rank sends to its own etp peer.
        self.own_tokens = etp_size != tp_size
        if self.own_tokens and tp_size > 1 and not self.sequence_parallel:
            raise ValueError(f"expert tensor parallel size {etp_size} differs from tensor parallel size {tp_size}: "
                             "each rank routes its own tokens, which needs sequence parallelism")
        per_rank = c.num_experts // ep_size
        self.local = range(ep_rank * per_rank, (ep_rank + 1) * per_rank)
        # a token copy goes to one rank per etp rank of its expert when this rank routes its own tokens
        self.dispatcher = TokenDispatcher(exchange_group if self.own_tokens else ep_group, ep_size,
                                          etp_size if self.own_tokens else 1, self.local)
        self.router = Router(c, init_method, device=device)
        self.experts = torch.nn.ModuleDict({str(e): expert() for e in self.local})
        for p in self.experts.parameters():  # the shard each holds (engine and checkpoints read it)
            p.tp_shard, p.tp_shard_group = (etp_rank, etp_size), (etp_group if etp_size > 1 else None)
            if etp_size == 1 and tp_size > 1 and not getattr(p, "tensor_model_parallel", False):
                p.tensor_model_parallel, p.partition_dim = True, 0  # a whole expert's bias: this rank's own
        # ``shared`` builds the shared expert (every token, every EP rank holds it whole), with its gate.
        self.shared_experts = shared() if shared is not None else None
        self.shared_gate = (SharedGate(c, init_method, device) if shared is not None and c.moe_shared_expert_gate
                            else None)

    @property
    def counter(self) -> Optional[dict]:
        """Bytes the all-to-alls send, by phase (set it to a dict to count)."""
        return self.dispatcher.counter

    @counter.setter
    def counter(self, value: Optional[dict]) -> None:
        self.dispatcher.counter = value

    def forward(self, x: torch.Tensor, cp: Optional[ContextParallel] = None) -> torch.Tensor:
        """``cp``: context parallelism, when each rank holds part of every sequence (the load-balancing
        loss then counts the tokens of all of them, and capacity is decided over whole sequences)."""
        c = self.config
        cp = cp if cp is not None and cp.group is not None and dist.get_world_size(cp.group) > 1 else None
        cp_group = cp.group if cp is not None else None
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        w = self.router.weight
        if self.sequence_parallel:  # each rank routes its own tokens: the weight's gradient is partial
            w = mpu.copy_to_tensor_model_parallel_region(w, self.tp_group)
        dtype = torch.float64 if c.moe_router_dtype == "fp64" else torch.float32
        logits = F.linear(tokens.to(dtype), w.to(dtype))
        bias = self.router.expert_bias if c.moe_router_enable_expert_bias else None
        top, weights, probs = route(logits, c.moe_router_topk, c.moe_router_pre_softmax, c.moe_router_score_function,
                                    c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk_scaling_factor,
                                    bias)
        aux = self._aux_losses(logits, probs, top, b, cp_group)
        drop, slots = self._drops(top, weights, b, cp), self._slots(top.size(0), cp)
        if self.own_tokens:
            y = self._own_tokens(tokens, top, weights, bias, drop, slots)
        else:
            y = self._gathered_tokens(tokens, top, weights, bias, drop, slots)
        y = y.view(s, b, h)
        return _WithAuxGrad.apply(y, aux, self.aux_scale) if aux is not None else y

    def _gathered_tokens(self, tokens: torch.Tensor, top: torch.Tensor, weights: torch.Tensor, bias,
                         drop: Optional[torch.Tensor], slots: Optional[int]) -> torch.Tensor:
        """Expert TP = TP: the TP group's tokens gathered, each TP rank's expert shards over all of them,
        the partial outputs (routed and shared) reduced (scattered under SP) over TP once. ``drop``:
        :meth:`_drops` of the gathered tokens."""
        c = self.config
        if self.sequence_parallel:
            tokens = mpu.gather_from_sequence_parallel_region(tokens, self.tp_group)
            weights = mpu.gather_from_sequence_parallel_region(weights, self.tp_group)
            top = all_gather_first_dim(top, self.tp_group)
        elif self.tp_size > 1:  # every TP rank routes the same tokens; the experts' outputs are partial over
            # TP, so the gradients of their inputs and of the weights that combine them are summed over TP
            # ([T, h] and [T, k] in backward) as the gathers' reduce-scatters do under SP
            tokens = mpu.copy_to_tensor_model_parallel_region(tokens, self.tp_group)
            weights = mpu.copy_to_tensor_model_parallel_region(weights, self.tp_group)
        if bias is not None and self._recording():  # the micro-batch's load (gathered over TP), for the step's update
            self.router.tokens_per_expert += _counts(top.reshape(-1), c.num_experts).to(top.device).float()
        y = self._experts(tokens, top, weights.to(tokens.dtype), drop, slots)  # the routing in fp64 only when asked
        if self.shared_experts is not None:
            y = y + self._shared(tokens)
        if self.sequence_parallel:
            return mpu.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        if self.tp_size > 1:
            return mpu.reduce_from_tensor_model_parallel_region(y, self.tp_group)
        return y

    def _own_tokens(self, tokens: torch.Tensor, top: torch.Tensor, weights: torch.Tensor, bias,
                    drop: Optional[torch.Tensor], slots: Optional[int]) -> torch.Tensor:
        """Expert TP other than TP: this rank's own tokens go to their experts' etp ranks, whose partial
        outputs come back and are summed here; only the shared expert (sharded over TP) gathers over TP.
        The load figures are counted over the TP group's tokens, as one process does."""
        c = self.config
        loads = self._recording() and (bias is not None or not self._balancing())
        whole = all_gather_first_dim(top, self.tp_group) if self.sequence_parallel and loads else top
        if loads:
            counts = _counts(whole.reshape(-1), c.num_experts).to(top.device)
            if bias is not None:
                self.router.tokens_per_expert += counts.float()
            if not self._balancing():
                self.aux_scale.loads.append(counts.max().float() / counts.float().mean())
        y = self._experts(tokens, top, weights.to(tokens.dtype), drop, slots, record_loads=False)
        if self.shared_experts is None:
            return y
        gathered = mpu.gather_from_sequence_parallel_region(tokens, self.tp_group) if self.sequence_parallel else tokens
        shared = self._shared(gathered)
        if self.sequence_parallel:
            return y + mpu.reduce_scatter_to_sequence_parallel_region(shared, self.tp_group)
        return y + shared

    def _shared(self, tokens: torch.Tensor) -> torch.Tensor:
        """The shared expert over ``tokens`` (all of the TP group's), partial over TP, gated when asked."""
        shared = self.shared_experts.partial(tokens)
        if self.shared_gate is not None:
            shared = shared * self.shared_gate(tokens, self.tp_group if self.tp_size > 1 else None)
        return shared

    def _aux_losses(self, logits: torch.Tensor, probs: torch.Tensor, top: torch.Tensor, batch: int = 1,
                    cp_group: Optional[dist.ProcessGroup] = None) -> Optional[torch.Tensor]:
        """This rank's share of the layer's load-balancing and z losses over the micro-batch's tokens
        (under SP the shares of the TP ranks add up to them); None when both are off. ``aux_loss`` is
        Switch's over the micro-batch; ``seq_aux_loss`` the same per sequence (DeepSeek-V2's), averaged
        over the micro-batch's ``batch`` sequences, so that any split of a global batch into micro-batches
        and data-parallel ranks gives the same loss."""
        c = self.config
        kind, use_aux = c.moe_router_load_balancing_type, self._balancing()
        if not use_aux and c.moe_z_loss_coeff <= 0:
            return None
        cp = dist.get_world_size(cp_group) if cp_group is not None else 1
        tokens = logits.size(0) * (self.tp_size if self.sequence_parallel else 1) * cp
        total = logits.new_zeros(())
        if use_aux:
            e, k = c.num_experts, c.moe_router_topk
            if kind == "aux_loss":
                counts = _counts(top.reshape(-1), e).to(device=probs.device, dtype=probs.dtype)
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
            if self._recording():  # the load over the whole micro-batch, as these counts are
                whole = counts if counts.dim() == 1 else counts.sum(0)
                self.aux_scale.loads.append(whole.max() / whole.mean())
            scale = c.moe_aux_loss_coeff * e / (k * length * length)
            total = total + scale * (probs_sum * counts).sum() / (batch if kind == "seq_aux_loss" else 1)
        if c.moe_z_loss_coeff > 0:
            total = total + c.moe_z_loss_coeff * torch.logsumexp(logits, dim=-1).square().sum() / tokens
        if self._recording():
            self.aux_scale.losses.append(total.detach())
        return total

    def _balancing(self) -> bool:
        """Whether a load-balancing loss is on (it counts the loads over the whole micro-batch)."""
        c = self.config
        return c.moe_router_load_balancing_type in ("aux_loss", "seq_aux_loss") and c.moe_aux_loss_coeff > 0

    def _recording(self) -> bool:
        """Whether this forward's figures go to the log: in training, once per micro-batch (under full
        recomputation the first, gradient-free pass is skipped; the recomputation records)."""
        return self.training and torch.is_grad_enabled()

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
            index = self._token_index(rows.size(0) // batch, batch, cp).double().unsqueeze(1)
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

    @staticmethod
    def _token_index(length: int, batch: int, cp: ContextParallel) -> torch.Tensor:
        """``[length * batch]`` one process's flat index (position x batch + sample) of this CP rank's
        tokens, held ``[length, batch]`` flattened."""
        if cp.sample_positions is not None:  # documents balanced per sample: each its own positions
            positions = cp.sample_positions.t()
        else:
            positions = cp.shard.positions.view(-1, 1).expand(length, batch)
        sample = torch.arange(batch, device=positions.device).view(1, -1)
        return (positions.to(sample.device) * batch + sample).reshape(-1)

    def _over_capacity(self, top: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """The token copies over their experts' capacity (:func:`over_capacity`), their share recorded."""
        c = self.config
        drop = over_capacity(top, weights, c.num_experts, self._capacity_factor(), c.moe_token_drop_policy,
                             c.moe_min_capacity)
        if self._recording():
            self.aux_scale.dropped.append(drop.float().mean())
        return drop

    def _experts(self, tokens: torch.Tensor, top: torch.Tensor, weights: torch.Tensor,
                 drop: Optional[torch.Tensor] = None, slots: Optional[int] = None,
                 record_loads: bool = True) -> torch.Tensor:
        """Each token's k expert outputs, weighted and summed: ``[T, h]`` (partial over TP when the tokens
        were gathered over TP; whole when this rank routed its own). ``drop``: the copies over capacity;
        ``slots``: pad each expert's rows to this many (:meth:`_padded_experts`)."""
        c = self.config
        n, k = top.shape
        flat = top.reshape(-1)
        buckets = c.num_experts
        if drop is not None:  # copies over capacity go to a bucket past the last expert: sorted last, sent nowhere, output 0
            flat, buckets = torch.where(drop.reshape(-1), c.num_experts, flat), c.num_experts + 1
        order = torch.argsort(flat, stable=True)  # token copies by expert, then by token
        counts = _counts(flat, buckets)[:c.num_experts]
        rows = tokens.index_select(0, order // k)
        if record_loads and self._recording() and not self._balancing():  # else the loss recorded the micro-batch's
            self.aux_scale.loads.append(counts.max().float() / counts.float().mean())
        if slots is not None:
            return self._padded_experts(rows, flat, order, weights, slots)
        plan = None
        if self.dispatcher.ranks > 1:
            rows, plan = self.dispatcher.dispatch(rows, counts)
        per_expert = plan[0] if plan is not None else counts.tolist()  # the one host read of the layer
        if plan is None:
            rows = rows[:sum(per_expert)]  # without the dropped copies
        out = self._expert_mlps(rows, per_expert)
        if plan is not None:
            out = self.dispatcher.combine(out, plan)
        if out.size(0) < n * k:  # the dropped copies' outputs: zeros
            out = torch.cat([out, out.new_zeros(n * k - out.size(0), out.size(1))])
        out = out.index_select(0, torch.argsort(order))  # back to (token, choice) order
        return (out.view(n, k, -1) * weights.unsqueeze(-1)).sum(1)

    def _padded_experts(self, rows: torch.Tensor, flat: torch.Tensor, order: torch.Tensor, weights: torch.Tensor,
                        slots: int) -> torch.Tensor:
        """:meth:`_experts` with every expert given ``slots`` rows by this rank (its kept copies in token
        order, then zero rows): every size is known on the host, so nothing waits for the device. ``rows``
        are the token copies sorted by expert (dropped ones last), ``order`` that sort of ``flat``."""
        n, k = weights.shape
        src, slot = padded_slots(flat, order, self.config.num_experts, slots)
        rows = torch.cat([rows, rows.new_zeros(1, rows.size(1))])  # the padding's zero row
        got = self.dispatcher.dispatch_padded(rows.index_select(0, src), slots)  # sent expert-major
        out = self._expert_mlps(got, [self.dispatcher.ranks * slots] * len(self.local))
        out = self.dispatcher.combine_padded(out, slots)
        out = torch.cat([out, out.new_zeros(1, out.size(1))])  # a dropped copy's output: zeros
        return (out.index_select(0, slot).view(n, k, -1) * weights.unsqueeze(-1)).sum(1)

    def _expert_mlps(self, rows: torch.Tensor, per_expert: list) -> torch.Tensor:
        """This rank's experts over their rows (``per_expert[i]`` consecutive rows for local expert i)."""
        if self._grouped(rows):
            return self._grouped_mlp(rows, per_expert)
        return torch.cat([self.experts[str(e)].partial(chunk) for e, chunk in zip(self.local, rows.split(per_expert))])

    def _grouped(self, rows: torch.Tensor) -> bool:
        """Whether the experts run as grouped matmuls (asked, available, the dtype and widths allow)."""
        if not self.config.moe_grouped_gemm or not grouped_matmul_available(rows.dtype, rows.device):
            return False
        if self.config.add_bias_linear:  # the grouped matmuls carry no biases: the loop adds them
            return False
        fc2 = self.experts[str(self.local.start)].linear_fc2.weight
        size = rows.element_size()
        return (rows.size(-1) * size) % 16 == 0 and (fc2.size(1) * size) % 16 == 0

    def _grouped_mlp(self, rows: torch.Tensor, per_expert: list) -> torch.Tensor:
        """Every local expert's MLP over its rows in two grouped matmuls (the same bits as the loop)."""
        experts = [self.experts[str(e)] for e in self.local]
        offs = group_offsets(per_expert, rows.device)
        h = experts[0]._act(grouped_linear(rows, offs, [m.linear_fc1.weight for m in experts]))
        return grouped_linear(h, offs, [m.linear_fc2.weight for m in experts])
