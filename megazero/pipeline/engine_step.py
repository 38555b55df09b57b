"""One pipelined training step through a ZeRO engine's public API.

Per micro-batch the last virtual stage calls ``engine.backward(loss)`` (scaled by the
loss scale and 1 / micro-batches, exactly as without a pipeline); every other stage
back-propagates the gradient it received with :func:`backward_step`, unscaled, since
that gradient already carries the scale. After the schedule the tied word embedding's
gradient is completed over the embedding group (first + last stage, Megatron's
``_allreduce_word_embedding_grads``), then the engine steps once per micro-batch, so its
accumulation boundary (and the gradient norm and overflow check, agreed over DP and
then the TP x PP model-parallel group) comes after every rank's last backward.

With ``v`` model chunks per rank the chunks live in one module (the model side's
``StageChunks``) under one engine, so the optimizer, the norm and the accumulation
window cover them all. ``pp = 1`` is the trivial schedule of the same step (forward and
backward of each micro-batch in turn, no transfers): one step for every layout.

Losses stay on the device (no host synchronisation per micro-batch); the caller
reduces them when it logs.
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist

from .p2p import PipeP2P
from .runner import ScheduleRunner
from .stage_model import StageModel

__all__ = ["backward_step", "TiedEmbeddingGradSync", "PipelineStage", "shared_copy_parameters", "MicroBatch"]

# A micro-batch: whatever the chunks' ``stage_inputs`` take (e.g. ``(input_ids, labels)`` or the model's
# batch object); every stage gets it, and the last stage's ``loss_fn`` reads it too.
MicroBatch = Union[tuple[torch.Tensor, torch.Tensor], Any]


def _engine_takes_output_grad(engine) -> bool:
    try:
        return len(inspect.signature(engine.backward).parameters) >= 2
    except (TypeError, ValueError):
        return False


def backward_step(engine, output: torch.Tensor, output_grad: Optional[torch.Tensor] = None) -> None:
    """Back-propagate through ``engine``: ``backward(loss)`` on the last stage, else ``output_grad`` into ``output``.

    Uses ``engine.backward(output, output_grad)`` when the engine has it (autograd with the
    engine's bookkeeping, no scaling). Older engines only take a scalar loss that they
    multiply by ``loss_scale / accumulation_steps``; for those the same gradient is produced
    by the scalar ``<output, output_grad> * accumulation_steps / loss_scale`` (exact up to
    one rounding of the two scale factors), which keeps their per-backward bookkeeping
    (ZeRO-2/3 reduce-scatters) intact.
    """
    if output_grad is None:
        engine.backward(output)
    elif _engine_takes_output_grad(engine):
        engine.backward(output, output_grad)
    else:
        accum = getattr(engine, "accum", engine.config.gradient_accumulation_steps)
        surrogate = torch.sum(output * output_grad.to(output.dtype)) * (accum / engine.get_loss_scale())
        engine.backward(surrogate)


def shared_copy_parameters(module: torch.nn.Module) -> list[torch.nn.Parameter]:
    """Parameters that are a pipeline stage's copy of another stage's (the tied head's embedding)."""
    return [p for p in module.parameters() if getattr(p, "pipeline_shared_copy", False)]


class TiedEmbeddingGradSync:
    """Completes the tied word embedding's gradient over the embedding group after each step's backwards.

    Each micro-batch's gradient of the local copy is also added into a side buffer (a
    tensor hook: it reads, never changes, what the engine accumulates). After the last
    backward the buffers are exchanged over the embedding group and the other stage's
    sum is back-propagated into the parameter through the engine, so first and last
    stage end the step with the same, complete gradient. The exchange waits for the
    end of the schedule because the two stages run their backwards at different times:
    a collective inside a backward would deadlock the pipeline.
    """

    def __init__(self, param: torch.nn.Parameter, group: Optional[dist.ProcessGroup]) -> None:
        self.param, self.group = param, group
        self.stash: Optional[torch.Tensor] = None
        self._injecting = False
        # The hook lives in the parameter's autograd metadata, which Python's garbage collector cannot
        # traverse: a bound method there (self -> param -> hook -> self) would never be collected.
        this = weakref.ref(self)

        def hook(grad: torch.Tensor) -> None:
            sync = this()
            if sync is not None:
                sync._hook(grad)

        self._handle = param.register_hook(hook)

    def _hook(self, grad: torch.Tensor) -> None:
        if self._injecting:
            return
        # Summed in fp32 whatever the compute dtype: bf16 sums drift the two copies apart.
        grad = grad.detach().float()
        self.stash = grad.clone() if self.stash is None else self.stash.add_(grad)

    def sync(self, engine) -> None:
        own = self.stash if self.stash is not None else torch.zeros_like(self.param, dtype=torch.float32)
        self.stash = None
        parts = [torch.empty_like(own) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(parts, own.contiguous(), group=self.group)
        me = dist.get_rank(self.group)
        peer = sum(p for i, p in enumerate(parts) if i != me)
        if hasattr(engine, "accumulate_grad_"):
            engine.accumulate_grad_(self.param, peer)
            return
        self._injecting = True
        try:
            backward_step(engine, self.param, peer.to(self.param.dtype))
        finally:
            self._injecting = False

    def remove(self) -> None:
        self._handle.remove()


class PipelineStage:
    """One pipeline rank's share of training: its chunks under a ZeRO engine, its schedule, its p2p.

    ``chunks`` are this rank's model chunks (:class:`~megazero.pipeline.stage_model.StageModel` each);
    ``engine`` wraps ``chunks[0]`` when ``v == 1`` or a module holding every chunk otherwise
    (``forward(chunk, *args)``). ``groups`` is the :class:`megazero.mpu.ParallelGroups`;
    ``micro_batch_size`` and ``seq_length`` fix the shape of the activations crossing stage
    boundaries. ``loss_fn(per_token_loss, micro_batch)`` reduces the last stage's output to the
    micro-batch's scalar loss (default: the mean). With ``pp = 1`` the same object runs the
    trivial schedule.
    """

    def __init__(self, engine, chunks: Sequence[StageModel], groups, *, micro_batch_size: int, seq_length: int,
                 loss_fn: Optional[Callable[[torch.Tensor, MicroBatch], torch.Tensor]] = None) -> None:
        self.engine, self.chunks, self.groups = engine, list(chunks), groups
        self.v = len(self.chunks)
        shape, dtype = self.chunks[0].stage_activation(micro_batch_size, seq_length, groups,
                                                       getattr(engine, "compute_dtype", None))
        self.p2p = PipeP2P(groups.pp_group, groups.pp_ranks, device=getattr(engine, "device", "cpu"))
        self.runner = ScheduleRunner(self.p2p, groups.pp_size, groups.pp_rank, self.v, shape, dtype)
        self.loss_fn = loss_fn or (lambda per_token, mb: per_token.mean())
        self.tied: Optional[TiedEmbeddingGradSync] = None
        # A weight shared by the first and last stage (a tied head's embedding): completed over their group.
        if groups.pp_size > 1 and groups.in_embedding_group:
            end = self.chunks[0] if groups.pp_rank == 0 else self.chunks[-1]
            shared = end.shared_embedding()
            if shared is not None:
                self.tied = TiedEmbeddingGradSync(shared, groups.embedding_group)

    @property
    def is_last_stage(self) -> bool:
        return self.groups.pp_rank == self.groups.pp_size - 1

    def _forward(self, chunk: int, *args, **kwargs):
        return self.engine(*args, **kwargs) if self.v == 1 else self.engine(chunk, *args, **kwargs)

    def _chunk_forward(self, mb: MicroBatch, chunk: int, x: Optional[torch.Tensor]) -> torch.Tensor:
        last = self.runner.is_last(chunk)
        if x is not None:
            self.chunks[chunk].set_input_tensor(x)
        args, kwargs = self.chunks[chunk].stage_inputs(mb, first=x is None, last=last)
        out = self._forward(chunk, *args, **kwargs)
        return self.loss_fn(out, mb) if last else out

    def _set_accumulation(self, m: int) -> None:
        """The step's micro-batches are its accumulation window (batch-size ramp-up changes it)."""
        accum = getattr(self.engine, "accum", None)
        if accum is None:
            accum = self.engine.config.gradient_accumulation_steps
        if accum != m:
            if not hasattr(self.engine, "set_gradient_accumulation_steps"):
                raise ValueError(f"{m} micro-batches given, but the engine accumulates {accum} and cannot change it")
            self.engine.set_gradient_accumulation_steps(m)

    def train_step(self, micro_batches: Sequence[MicroBatch],
                   lap: Optional[Callable[[str], None]] = None) -> tuple[list[torch.Tensor], bool]:
        """Forward and backward every micro-batch through the schedule, then step.

        Returns the micro-batch losses (detached device tensors, on the last stage; empty
        elsewhere) and whether the parameters were updated. Every stage needs the
        micro-batches: the first for the inputs, the last for the labels, all of them for
        positions and masks. ``lap(phase)`` is called after each forward ("fwd"), backward
        ("bwd") and the optimizer step ("step"), for wall-clock breakdowns.
        """
        m = len(micro_batches)
        self._set_accumulation(m)
        tick = lap or (lambda phase: None)

        def forward_step(i: int, chunk: int, x: Optional[torch.Tensor]) -> torch.Tensor:
            out = self._chunk_forward(micro_batches[i], chunk, x)
            tick("fwd")
            return out

        def bwd(chunk: int, output: torch.Tensor, output_grad: Optional[torch.Tensor]) -> None:
            backward_step(self.engine, output, output_grad)
            tick("bwd")

        losses = self.runner.run(m, forward_step, bwd)
        if self.tied is not None:
            self.tied.sync(self.engine)
        updated = False
        for _ in range(m):
            updated = self.engine.step()
        tick("step")
        return losses, updated

    @torch.no_grad()
    def forward_only(self, micro_batches: Sequence[MicroBatch]) -> list[torch.Tensor]:
        """Forward every micro-batch through the pipeline without backward (evaluation).

        Micro-batch by micro-batch, virtual stage by virtual stage: each rank receives a
        micro-batch's activation, runs its chunk and sends the result on, so with one chunk
        per rank consecutive micro-batches overlap across stages as in Megatron's
        forward-only schedule, and every send meets a receive its peer posts next (no
        deadlock whatever the order of blocking sends). Returns the per-micro-batch losses
        (device tensors) on the last stage (empty elsewhere); no gradient and no engine state change.
        """
        pp, rank = self.groups.pp_size, self.groups.pp_rank
        losses = []
        for mb in micro_batches:
            for chunk in range(self.v):
                first = rank == 0 and chunk == 0
                x = None
                if not first:
                    prev = (rank - 1) % pp
                    x = self.p2p.exchange([], [(prev, self.runner.tensor_shape, self.runner.dtype)])[0]
                out = self._chunk_forward(mb, chunk, x)
                if self.runner.is_last(chunk):
                    losses.append(out.detach())
                else:
                    self.p2p.exchange([((rank + 1) % pp, out)], [])
        return losses
