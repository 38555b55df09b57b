"""Multi-token prediction (DeepSeek-V3 §2.2, Megatron-core's ``multi_token_prediction.py``).

After the last transformer layer, module ``k`` (1..D) predicts token ``t_{i+k+1}`` at position ``i``:

    h^k_i = FinalNorm_k( TransformerLayer_k( M_k [RMSNorm(Emb(t_{i+k})); RMSNorm(h^{k-1}_i)] ) )
    logits^k_i = OutputHead(h^k_i)

with ``h^0`` the main model's last hidden states after its final norm (what its head reads, as in
Megatron-core and as DeepSeek's released MTP weights are served), the embedding and the output head
shared with the main model, and ``M_k`` = ``eh_proj`` ``[h, 2h]``. The loss is

    L_MTP = (lambda / D) * sum_k  sum_i mask^k_i CE(logits^k_i, t_{i+k+1}) / N_k

where ``N_k`` is the count of valid targets of depth ``k`` over the *whole* global batch (every
data-parallel rank and micro-batch), so the gradient is the global per-token one whatever the
split. The loss does not travel with the activations: its gradient is attached to ``h^0`` in
backward (as the routers' auxiliary losses are), so the per-token LM loss stays the model's output
and pipeline schedules are unchanged. Nothing of it reaches the main model at ``lambda = 0``: the
MTP layers' own mixture-of-experts losses are scaled by ``lambda / D`` as well.

Targets come from the whole sequence before it is split for context parallelism
(:func:`multi_token_targets`): a shifted token never crosses the end of the sequence, nor a document
boundary when documents are packed (``documents``), and is masked like the label it replaces.

Names (Megatron-core's): ``mtp.layers.{k}.enorm``, ``.hnorm``, ``.eh_proj``, ``.transformer_layer.*``,
``.final_layernorm``.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megazero import mpu

from .attached_loss import attach_loss
from .config import GPTConfig
from .forward_context import ForwardContext
from .init import init_methods
from .layer_spec import ExpertParallel, layer_spec
from .moe.router import AuxLossScale
from .norms import build_norm
from .transformer import TransformerLayer


__all__ = ["MultiTokenPrediction", "MTPLayer", "multi_token_targets"]


def multi_token_targets(labels: torch.Tensor, loss_mask: torch.Tensor, depth: int,
                        document_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(targets, mask)`` ``[depth, b, s]`` of depths 1..``depth`` from a whole sequence's ``labels`` and
    ``loss_mask`` ``[b, s]``: ``targets[k-1, :, i] = labels[:, i + k]`` (0 past the end) and ``mask`` the
    shifted loss mask, zero past the end and, with ``document_ids`` ``[b, s]`` (each input token's
    document), where position ``i + k`` lies in another document than ``i``. Depth ``k``'s input tokens
    are depth ``k-1``'s targets (``labels`` for ``k = 1``)."""
    b, s = labels.shape
    targets = labels.new_zeros(depth, b, s)
    mask = loss_mask.new_zeros(depth, b, s)
    for k in range(1, depth + 1):
        if k >= s:
            break
        targets[k - 1, :, :s - k] = labels[:, k:]
        m = loss_mask[:, k:].clone()
        if document_ids is not None:
            m = m * (document_ids[:, k:] == document_ids[:, :s - k]).to(m.dtype)
        mask[k - 1, :, :s - k] = m
    return targets, mask


class MTPLayer(torch.nn.Module):
    """One prediction depth: the two norms, the projection and a transformer layer of the model's own
    kind (the last decoder layer's attention and MLP builders), then its final norm."""

    def __init__(self, config: GPTConfig, *, number: int, tp_group: Optional[dist.ProcessGroup], tp_size: int,
                 device=None, experts: Optional[ExpertParallel] = None) -> None:
        super().__init__()
        c = config
        kw = dict(tp_group=tp_group, tp_size=tp_size, device=device)
        self.tp_group, self.tp_size = tp_group, tp_size
        self.sequence_parallel = c.sequence_parallel and tp_size > 1
        self.enorm = build_norm(c, **kw)
        self.hnorm = build_norm(c, **kw)
        self.eh_proj = mpu.ColumnParallelLinear(2 * c.hidden_size, c.hidden_size, bias=False, gather_output=False,
                                                init_method=init_methods(c)[0], tp_group=tp_group,
                                                params_dtype=c.params_dtype, device=device,
                                                sequence_parallel=c.sequence_parallel)
        self.transformer_layer = TransformerLayer(c, number=number, experts=experts,
                                                  spec=layer_spec(c, c.num_layers - 1), **kw)
        self.final_layernorm = build_norm(c, **kw)

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        """``hidden`` and ``embedded`` ``[s(/tp), b, h]`` -> this depth's hidden states, same shape."""
        x = torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1)
        x, _ = self.eh_proj(x)  # [s, b, h/tp]
        if self.tp_size > 1:
            x = mpu.gather_from_tensor_model_parallel_region(x, self.tp_group)  # [s, b, h]
            if self.sequence_parallel:
                x = mpu.scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h]
        return self.transformer_layer(x, context)


@dataclasses.dataclass
class MTPScale:
    """What each depth's loss is multiplied by: ``log`` for the logged value (1 / N_k, times the
    data-parallel size, which the mean over ranks divides out) and ``grad`` for its gradient
    (``log`` x lambda / D x the loss scale). None: this micro-batch's own count (a plain forward)."""

    log: Optional[torch.Tensor] = None  # [D]
    grad: Optional[torch.Tensor] = None  # [D]


class _DepthScale:
    """The ``value`` the attached loss's gradient reads in backward (one depth's)."""

    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class MultiTokenPrediction(torch.nn.Module):
    """The D prediction depths of a last pipeline stage; see the module docstring."""

    def __init__(self, config: GPTConfig, *, first_number: int, tp_group: Optional[dist.ProcessGroup], tp_size: int,
                 device=None, experts: Optional[ExpertParallel] = None) -> None:
        super().__init__()
        c = config
        self.depth, self.factor = c.mtp_num_layers, c.mtp_loss_scaling_factor
        # The MTP layers' routers: their losses scaled by lambda / D on top of the model's factor.
        self.moe_aux = AuxLossScale()
        experts = dataclasses.replace(experts, aux_scale=self.moe_aux) if experts is not None else None
        self.layers = torch.nn.ModuleList(
            MTPLayer(c, number=first_number + k, tp_group=tp_group, tp_size=tp_size, device=device, experts=experts)
            for k in range(self.depth))
        self.scale = MTPScale()
        self.records: list[torch.Tensor] = []  # per forward: [D] logged losses, detached

    def set_scale(self, scale: MTPScale, moe_aux_value) -> None:
        """This step's normalisation, and the MTP routers' factor (the model's times lambda / D)."""
        self.scale = scale
        self.moe_aux.value = moe_aux_value * (self.factor / self.depth)
        self.moe_aux.take()

    def take(self) -> list[torch.Tensor]:
        """The logged ``[D]`` losses of the forwards since the last call."""
        out, self.records = self.records, []
        self.moe_aux.take()
        return out

    def forward(self, hidden: torch.Tensor, labels: torch.Tensor, targets: torch.Tensor, mask: torch.Tensor,
                embed: Callable[[torch.Tensor], torch.Tensor],
                head: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], context: ForwardContext) -> torch.Tensor:
        """``hidden`` ``[s(/tp), b, h]`` (the main model's last hidden states, normed), ``labels`` ``[b, s]``,
        ``targets`` and ``mask`` ``[D, b, s]`` (:func:`multi_token_targets`, this rank's tokens); ``embed(ids
        [b, s])`` gives ``[s(/tp), b, h]``, ``head(h, targets [b, s])`` the per-token loss ``[b, s]`` of normed
        states. Returns ``hidden`` with the MTP loss's gradient attached."""
        losses = []
        h, inputs = hidden, labels
        for k, layer in enumerate(self.layers):
            h = layer.final_layernorm(layer(h, embed(inputs), context))
            per_token = head(h, targets[k])  # [b, s] fp32
            losses.append((per_token * mask[k]).sum())
            inputs = targets[k]
        sums = torch.stack(losses)  # [D]
        log = self.scale.log if self.scale.log is not None else 1.0 / mask.sum(dim=(1, 2)).clamp_min(1.0)
        grad = self.scale.grad if self.scale.grad is not None else log * (self.factor / self.depth)
        self.records.append((sums.detach() * log).float())
        if torch.is_grad_enabled():
            for k in range(self.depth):
                hidden = attach_loss(hidden, losses[k], _DepthScale(grad[k]))
        return hidden
