"""QK-clip (Kimi K2's MuonClip; Megatron's ``--qk-clip``) and the largest attention logit's log.

Every attention keeps the largest logit of each of its heads over a step's training forwards
(``GPTConfig.track_max_attention_logit``). After the optimizer has updated the fp32 masters and before
the weights are published from them (the engine's ``after_update`` hook), :class:`QKClip`

1. takes the maximum over the data-parallel ranks, which saw other samples (one all-reduce of every
   attention's heads together, on the accelerator: no host synchronisation);
2. with ``clip``, for each head ``eta = min(1, threshold / max logit)``, rescales the rows of the
   weights that make the head's queries and keys (``qk_clip_scales``: ``eta^alpha`` on the query side,
   ``eta^(1 - alpha)`` on the key side), in the master partition each rank holds: a head whose logits
   stayed under the threshold keeps factor 1, so every step does the same work whatever the values.

TP ranks clip their own heads (no exchange); each pipeline stage its own layers. :meth:`QKClip.largest`
gives the largest logit of the whole model for the log (a max over the model-parallel ranks, at the log
interval only).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from megazero.model.attention.self_attention import CausalAttention

__all__ = ["QKClip"]


class QKClip:
    """The after-update hook of one engine over the attentions of ``modules`` (a stage's model chunks)."""

    def __init__(self, modules: list[torch.nn.Module], *, clip: bool, threshold: float, alpha: float) -> None:
        self.attentions = [m for module in modules for m in module.modules() if isinstance(m, CausalAttention)]
        self.clip, self.threshold, self.alpha = clip, float(threshold), float(alpha)
        self.last: Optional[torch.Tensor] = None  # this rank's heads' largest logit at the last update
        self.device = next((p.device for m in modules for p in m.parameters()), torch.device("cpu"))

    @torch.no_grad()
    def __call__(self, engine) -> None:
        maxima = [a.max_logit for a in self.attentions]
        if not maxima or any(m is None for m in maxima):
            missing = [a.number for a, m in zip(self.attentions, maxima) if m is None]
            raise RuntimeError(f"QK-clip: the attention of layers {missing} ran no training forward in this step")
        heads = torch.cat(maxima)
        engine.comm.all_reduce(heads, "dp", op=dist.ReduceOp.MAX)  # data (x context) parallel: other samples
        self.last = heads.amax()
        if self.clip:
            eta = self.threshold / torch.clamp(heads, min=self.threshold)  # 1 at or under the threshold
            at = 0
            for a, m in zip(self.attentions, maxima):
                for weight, factors in a.qk_clip_scales(eta[at:at + m.numel()], self.alpha):
                    engine.scale_rows(weight, factors)
                at += m.numel()
        for a in self.attentions:
            a.max_logit = None

    def largest(self, mp_group: Optional[dist.ProcessGroup]) -> float:
        """The largest attention logit of the whole model at the last update (collective over ``mp_group``,
        the model-parallel ranks; every rank gets it)."""
        value = self.last if self.last is not None else torch.tensor(float("-inf"), device=self.device)
        value = value.reshape(1).float()
        if mp_group is not None and dist.is_initialized() and dist.get_world_size(mp_group) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX, group=mp_group)
        return float(value)
