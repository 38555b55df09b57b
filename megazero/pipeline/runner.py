"""Execute one rank's schedule: forwards and backwards it is handed, transfers over p2p.

The runner owns the activations in flight: the input (made a leaf that requires grad,
so its gradient is what goes upstream) and the output of every forward whose
backward has not run yet. It knows neither the model nor the optimizer:

* ``forward_step(microbatch, chunk, input_tensor)`` returns the chunk's output
  (``input_tensor`` is None on the first virtual stage); on the last virtual stage
  the output is the micro-batch's scalar loss.
* ``backward_step(chunk, output, output_grad)`` runs autograd from ``output``
  (``output_grad`` is None on the last virtual stage, where ``output`` is the loss).

``max_live`` records the most forwards alive at once (the activation memory that
1F1B bounds by ``pp - rank`` micro-batches).
"""

from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from .p2p import PipeP2P
from .schedules import ACTIVATION, FORWARD, Compute, build_schedule

__all__ = ["ScheduleRunner"]

ForwardStep = Callable[[int, int, Optional[torch.Tensor]], torch.Tensor]
BackwardStep = Callable[[int, torch.Tensor, Optional[torch.Tensor]], None]


class ScheduleRunner:
    """Runs the schedule of pipeline rank ``pp_rank`` (``pp`` ranks, ``v`` chunks each).

    ``tensor_shape`` is the shape of every activation (and gradient) crossing a stage
    boundary; ``dtype`` its dtype (the compute dtype).
    """

    def __init__(self, p2p: Optional[PipeP2P], pp: int, pp_rank: int, v: int, tensor_shape: Sequence[int],
                 dtype: torch.dtype = torch.float32) -> None:
        self.p2p, self.pp, self.pp_rank, self.v = p2p, pp, pp_rank, v
        self.tensor_shape, self.dtype = tuple(tensor_shape), dtype
        self.max_live = 0

    def is_last(self, chunk: int) -> bool:
        return self.pp_rank == self.pp - 1 and chunk == self.v - 1

    def run(self, num_microbatches: int, forward_step: ForwardStep, backward_step: BackwardStep) -> list[torch.Tensor]:
        """One training step's forwards and backwards; returns the last stage's losses (detached, by micro-batch)."""
        steps = build_schedule(self.pp, self.v, num_microbatches, self.pp_rank)
        inputs: dict[tuple[int, int], Optional[torch.Tensor]] = {}  # received, waiting for their forward
        grads_in: dict[tuple[int, int], torch.Tensor] = {}  # received output grads, waiting for their backward
        live: dict[tuple[int, int], tuple[Optional[torch.Tensor], torch.Tensor]] = {}
        to_send: dict[tuple[str, int, int], torch.Tensor] = {}
        losses: dict[int, torch.Tensor] = {}
        for step in steps:
            if isinstance(step, Compute):
                key = (step.microbatch, step.chunk)
                if step.kind == FORWARD:
                    x = inputs.pop(key, None)
                    if x is not None:
                        x = x.requires_grad_()
                    out = forward_step(step.microbatch, step.chunk, x)
                    live[key] = (x, out)
                    self.max_live = max(self.max_live, len(live))
                    if self.is_last(step.chunk):
                        losses[step.microbatch] = out.detach()
                    else:
                        to_send[(ACTIVATION, *key)] = out
                else:
                    x, out = live.pop(key)
                    backward_step(step.chunk, out, None if self.is_last(step.chunk) else grads_in.pop(key))
                    if x is not None:
                        if x.grad is None:
                            raise RuntimeError(f"micro-batch {key[0]} chunk {key[1]}: the stage input received no "
                                               "gradient; does the forward step use its input_tensor?")
                        to_send[("gradient", *key)] = x.grad
                continue
            sends = [(t.peer, to_send.pop((t.what, t.microbatch, t.chunk))) for t in step.transfers if t.send]
            recvs = [t for t in step.transfers if not t.send]
            got = self.p2p.exchange(sends, [(t.peer, self.tensor_shape, self.dtype) for t in recvs])
            for t, buf in zip(recvs, got):
                (inputs if t.what == ACTIVATION else grads_in)[(t.microbatch, t.chunk)] = buf
        if live or to_send or inputs or grads_in:
            raise RuntimeError(f"schedule ended with work left: live {sorted(live)}, unsent {sorted(to_send)}")
        return [losses[i] for i in sorted(losses)]
