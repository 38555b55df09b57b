"""Mixture of experts (Megatron-core's MoELayer): a top-k router, experts sharded over the
expert-parallel (EP) ranks, and a dropless dispatch by all-to-all, joined here.

Per layer, on this rank's tokens ``[s(/tp), b, h]`` (no norm: the transformer layer's comes before):

1. **Route** (:class:`~.router.Router`): the top k experts of each token and their weights, the copies
   over capacity when there is one, and the auxiliary losses, whose gradients the router adds in
   backward through the layer's output (:class:`AuxLossScale`), not through the activations.
2. **Dispatch** (:mod:`~.dispatch`): the copies sorted by expert, each sent to the rank holding its
   expert (experts ``r*E/ep ..`` on EP rank ``r``) by one uneven all-to-all; the rows an expert receives
   are ordered by (source rank, token), one process's token order, so the expert's matmuls see the same
   rows at any EP.
3. **Experts** (:class:`~.experts.Experts`): ``mlp.py``'s MLPs (biases and all) named by their global index,
   each sharded over the expert tensor-parallel (ETP) group, TP by default; their outputs are partial sums
   over ETP.
4. **Combine**: the reverse all-to-all, then each token's k outputs weighted and summed; the shared
   expert (every token, gated when asked) added.

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

from typing import Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu
from megazero.mpu.initializers import initialize_sharded_
from megazero.mpu.mappings import all_gather_first_dim

from ..attention.cp.context import ContextParallel
from ..config import GPTConfig
from .dispatch import Permutation, TokenDispatcher, padded_slots, permute, unpermute
from .experts import Experts, is_expert_parameter
from .router import AuxLossScale, Router, Routing
from .routing import over_capacity, route

__all__ = ["AuxLossScale", "Router", "MoELayer", "is_moe_layer", "is_expert_parameter", "route", "over_capacity"]


def is_moe_layer(config: GPTConfig, number: int) -> bool:
    """Layer ``number`` (its index in the whole model) is a mixture of experts."""
    return config.is_moe_layer(number)


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


class MoELayer(torch.nn.Module):
    """The MLP of a mixture-of-experts layer: ``[s(/tp), b, h]`` -> the same shape (see the module).

    ``expert`` builds one expert (an MLP sharded over the expert tensor-parallel group whose
    ``partial(x)`` skips its reduction); this rank holds experts ``ep_rank * E/ep .. (ep_rank+1) * E/ep - 1``
    of ``ep_group``. Expert tensor parallelism (``etp_*``) defaults to TP; when it differs,
    ``exchange_group`` is the etp x ep group (Megatron-core's expert tensor and model parallel group)
    the tokens travel over, and each rank routes its own tokens (sequence parallelism when tp > 1).
    Children: ``router``, ``experts`` (by global index), ``shared_experts`` and ``shared_gate``."""

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
        self.router = Router(c, init_method, device=device, tp_group=tp_group, tp_size=tp_size,
                             own_tokens=self.own_tokens, aux_scale=aux_scale)
        self.experts = Experts(c, expert, self.local, tp_size=tp_size, etp_size=etp_size, etp_rank=etp_rank,
                               etp_group=etp_group)
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
        cp = cp if cp is not None and cp.group is not None and dist.get_world_size(cp.group) > 1 else None
        s, b, h = x.shape
        tokens = x.reshape(s * b, h)
        routing = self.router(tokens, b, cp)
        if self.own_tokens:
            y = self._own_tokens(tokens, routing)
        else:
            y = self._gathered_tokens(tokens, routing)
        return self.router.attach_losses(y.view(s, b, h), routing)

    def _gathered_tokens(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Expert TP = TP: the TP group's tokens gathered, each TP rank's expert shards over all of them,
        the partial outputs (routed and shared) reduced (scattered under SP) over TP once. The routing's
        ``drop`` is of the gathered tokens."""
        top, weights = routing.top, routing.weights
        if self.sequence_parallel:
            tokens = mpu.gather_from_sequence_parallel_region(tokens, self.tp_group)
            weights = mpu.gather_from_sequence_parallel_region(weights, self.tp_group)
            top = all_gather_first_dim(top, self.tp_group)
        elif self.tp_size > 1:  # every TP rank routes the same tokens; the experts' outputs are partial over
            # TP, so the gradients of their inputs and of the weights that combine them are summed over TP
            # ([T, h] and [T, k] in backward) as the gathers' reduce-scatters do under SP
            tokens = mpu.copy_to_tensor_model_parallel_region(tokens, self.tp_group)
            weights = mpu.copy_to_tensor_model_parallel_region(weights, self.tp_group)
        self.router.count_for_bias(top)  # the micro-batch's load (gathered over TP), for the step's update
        # the routing in fp64 only when asked: the experts' outputs are weighted in their dtype
        y = self._routed(tokens, top, weights.to(tokens.dtype), routing)
        if self.shared_experts is not None:
            y = y + self._shared(tokens)
        if self.sequence_parallel:
            return mpu.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        if self.tp_size > 1:
            return mpu.reduce_from_tensor_model_parallel_region(y, self.tp_group)
        return y

    def _own_tokens(self, tokens: torch.Tensor, routing: Routing) -> torch.Tensor:
        """Expert TP other than TP: this rank's own tokens go to their experts' etp ranks, whose partial
        outputs come back and are summed here; only the shared expert (sharded over TP) gathers over TP.
        The load figures are counted over the TP group's tokens, as one process does."""
        self.router.record_own_loads(routing.top)
        y = self._routed(tokens, routing.top, routing.weights.to(tokens.dtype), routing, record_load=False)
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

    def _routed(self, tokens: torch.Tensor, top: torch.Tensor, weights: torch.Tensor, routing: Routing,
                record_load: bool = True) -> torch.Tensor:
        """Each token's k expert outputs, weighted and summed: ``[T, h]`` (partial over TP when the tokens
        were gathered over TP; whole when this rank routed its own): permute, dispatch, the experts,
        combine, unpermute. ``routing``: its copies over capacity and the slots to pad each expert to."""
        rows, perm = permute(tokens, top, routing.drop, self.config.num_experts)
        if record_load:  # after the drops: the copies the experts take
            self.router.record_load(perm.counts)
        if routing.slots is not None:
            return self._padded(rows, perm, weights, routing.slots)
        if self.dispatcher.ranks == 1:
            per_expert = perm.counts.tolist()  # the one host read of the layer
            return unpermute(self.experts(rows[:sum(per_expert)], per_expert), perm, weights)
        rows, plan = self.dispatcher.dispatch(rows, perm.counts)  # the sorted copies freed once sent
        # no name holds the combined outputs: unpermute frees them once reordered
        return unpermute(self.dispatcher.combine(self.experts(rows, plan[0]), plan), perm, weights)

    def _padded(self, rows: torch.Tensor, perm: Permutation, weights: torch.Tensor, slots: int) -> torch.Tensor:
        """:meth:`_routed` with every expert given ``slots`` rows by this rank (its kept copies in token
        order, then zero rows): every size is known on the host, so nothing waits for the device.
        ``rows``: the copies :func:`permute` sorted."""
        n, k = weights.shape
        src, slot = padded_slots(perm.flat, perm.order, self.config.num_experts, slots)
        rows = torch.cat([rows, rows.new_zeros(1, rows.size(1))])  # the padding's zero row
        got = self.dispatcher.dispatch_padded(rows.index_select(0, src), slots)  # sent expert-major
        out = self.experts(got, [self.dispatcher.ranks * slots] * len(self.local))
        out = self.dispatcher.combine_padded(out, slots)
        out = torch.cat([out, out.new_zeros(1, out.size(1))])  # a dropped copy's output: zeros
        return (out.index_select(0, slot).view(n, k, -1) * weights.unsqueeze(-1)).sum(1)
