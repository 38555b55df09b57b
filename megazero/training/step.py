"""One rank's model for any layout, and one training or evaluation step through it.

Every layout goes through the same object: this rank's model chunks (``pp = 1``: the
whole GPT; ``pp > 1``: its pipeline stage, ``v`` chunks with interleaving) under one
ZeRO engine, driven by :class:`megazero.pipeline.PipelineStage`, whose schedule is the
trivial one (forward, backward, next micro-batch) at ``pp = 1``. So per-document
positions and masks, the loss, ramp-up, timers and evaluation exist once.

Parameters are named as at ``pp = 1`` inside the engine (``param_names``), which is
what makes the initial weights, and every checkpoint, independent of the layout.

Losses stay on the device: :class:`LossLog` keeps each iteration's local loss and
reduces a whole log interval with one collective and one host synchronisation.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch
import torch.distributed as dist

from .. import zero
from ..data import GPTBatch, build_batch, masked_mean, to_device
from ..model.attention.cp_context import ContextParallel
from ..model.attention.cp_hierarchical import Hierarchy
from ..model.attention.cp_layout import zigzag_layout
from ..model.keyed_dropout import sample_keys
from ..model.moe.layer import Router, is_expert_parameter
from ..model.pipeline_split import build_pipeline_model, global_name_fn
from ..pipeline import PipelineStage
from .config import TrainConfig

__all__ = ["TrainModel", "LossLog", "megatron_no_weight_decay"]


def megatron_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: biases and normalization weights (1-D) train without weight decay."""
    return param.dim() == 1 or name.endswith(".bias")


def _loss(per_token: torch.Tensor, mb) -> torch.Tensor:
    """Megatron's loss_func: the mean per-token loss over the micro-batch's loss mask. Under context
    parallelism this rank's share of it: its tokens' sum over the whole sequence's count, so the
    shares of the context-parallel ranks add up to the mean, once."""
    if isinstance(mb, ContextParallelBatch):
        return (per_token.float() * mb.loss_mask.float()).sum() / mb.loss_tokens.clamp_min(1.0)
    return masked_mean(per_token, mb.loss_mask)


@dataclasses.dataclass
class ContextParallelBatch(GPTBatch):
    """This rank's tokens of a micro-batch split over the context-parallel ranks: inputs, labels,
    loss mask and global positions of its tokens, the attention's context, and the loss mask's sum
    over the whole sequence (every CP rank reads the whole sample, so it needs no collective)."""

    context_parallel: Optional[ContextParallel] = None
    loss_tokens: Optional[torch.Tensor] = None


def context_parallel_context(seq_length: int, groups, comm_type, device: torch.device,
                             hierarchical: tuple[int, ...] = ()) -> ContextParallel:
    """Rank ``groups.cp_rank``'s share of a ``seq_length`` sequence (chunks r and 2cp-1-r of 2cp), with
    the attention's context (``comm_type``: one exchange or one per layer; ``hierarchical``: a2a+p2p's
    sizes), its index tensors on ``device``. The same for every micro-batch of that length."""
    layout = zigzag_layout(seq_length, groups.cp_size)
    hierarchy = (Hierarchy.build(seq_length, hierarchical[0], hierarchical[1], groups.hcp_a2a_group,
                                 groups.hcp_p2p_group, device) if hierarchical else None)
    return ContextParallel.from_layout(layout, groups.cp_rank, groups.cp_group, comm_type, device=device,
                                       hierarchy=hierarchy)


def split_for_context_parallel(b: GPTBatch, ctx: ContextParallel,
                               documents: Optional[list[list[int]]] = None) -> ContextParallelBatch:
    """This rank's share of ``b`` under ``ctx`` (:func:`context_parallel_context`). ``documents``: each
    sample's packed documents as cu_seqlens (``--reset-attention-mask``); the ring takes them in place
    of the attention mask."""
    mask = b.attention_mask
    if documents is not None and {"p2p", "a2a+p2p"} & set(ctx.comm_types):
        # Rings in every layer: each sample's documents balanced over the ranks (its own placement).
        ctx = ctx.with_documents(documents, balanced=set(ctx.comm_types) == {"p2p"}, device=b.tokens.device)
        mask = mask if {"a2a", "allgather"} & set(ctx.comm_types) else None
    if ctx.sample_positions is not None:
        pos = ctx.sample_positions  # [b, s_local]
        take = lambda t: t.gather(1, pos)  # noqa: E731
    else:
        pos = ctx.shard.positions
        take = lambda t: t[:, pos]  # noqa: E731
    positions = take(b.position_ids) if b.position_ids is not None else pos
    return ContextParallelBatch(tokens=take(b.tokens), labels=take(b.labels), loss_mask=take(b.loss_mask),
                                position_ids=positions, attention_mask=mask, context_parallel=ctx,
                                dropout_keys=b.dropout_keys, loss_tokens=b.loss_mask.float().sum())


def document_bounds(text: torch.Tensor, eod: int) -> list[list[int]]:
    """Each sample's packed documents as cu_seqlens, from the loader's host tokens ``[b, s + 1]``: a
    document ends after each end-of-document token of the inputs (Megatron's reset semantics)."""
    s = text.size(1) - 1
    ends = (text[:, :s - 1] == eod).nonzero().tolist()  # an EOD at the last input ends nothing inside
    cuts: list[list[int]] = [[0] for _ in range(text.size(0))]
    for sample, i in ends:
        cuts[sample].append(i + 1)
    return [c + [s] for c in cuts]


def expert_partitioning(groups):
    """ZeRO's partitioning of the experts under expert (tensor) parallelism: each expert shard over the
    ranks that hold it (expert data parallel); every other parameter over data x context (None: the
    default)."""
    if groups.ep_size == 1 and groups.etp_size == groups.tp_size:
        return None
    edp = zero.Partitioning("edp", shard=groups.edp_group)
    return lambda name, param: edp if is_expert_parameter(name) else None


def _chunk_index(args: tuple, kwargs: dict) -> int:
    """Which virtual chunk a call of :class:`~megazero.model.pipeline_split.StageChunks` runs."""
    return args[0]


class TrainModel:
    """This rank's chunks, their ZeRO engine and the schedule that runs them, for ``groups``."""

    def __init__(self, config: TrainConfig, groups, device: torch.device) -> None:
        p = config.parallel
        self.config, self.groups, self.device = config, groups, device
        # Built on the meta device: every ZeRO stage materializes it partition by partition,
        # with values keyed by the pp = 1 names (equal to a full initialization at any layout).
        module, self.chunks = build_pipeline_model(config.model, groups, first=p.decoder_first_pipeline_num_layers,
                                                   last=p.decoder_last_pipeline_num_layers, device="meta")
        for router in (m for m in module.modules() if isinstance(m, Router) and hasattr(m, "expert_bias")):
            router.place_buffers(device)
        self.engine = zero.initialize(module, config.zero_config(), groups=groups,
                                      no_weight_decay=megatron_no_weight_decay, device=device,
                                      param_names=global_name_fn(self.chunks),
                                      forward_key=_chunk_index if len(self.chunks) > 1 else None,
                                      partitioning=expert_partitioning(groups))
        self._cp_contexts: dict[int, ContextParallel] = {}  # sequence length -> this rank's CP context
        self.stage = PipelineStage(self.engine, self.chunks, groups, micro_batch_size=config.schedule.micro_batch_size,
                                   seq_length=config.model.seq_length, loss_fn=_loss)

    @property
    def is_last_stage(self) -> bool:
        return self.stage.is_last_stage

    def micro_batch(self, text: torch.Tensor, eod: Optional[int], index: Optional[torch.Tensor] = None):
        """Megatron's get_batch: inputs, labels, loss mask, positions and attention mask of a micro-batch;
        with position-keyed dropout also the samples' keys, from their dataset ``index`` (the loader's)."""
        d = self.config.data
        # The ring takes each sample's documents as cut points, not as an [s, s] mask (16 GiB at 128K tokens).
        kinds = set(self.config.parallel.cp_comm_types) if self.groups.cp_size > 1 else set()
        ring_only = bool(kinds) and not kinds & {"a2a", "allgather"}
        b = build_batch(to_device(text, self.device), eod, d.reset_position_ids,
                        d.reset_attention_mask and not ring_only, d.eod_mask_loss)
        # Plain positions and plain causality are the model's defaults: passing nothing keeps flash attention usable.
        b = b if d.reset_position_ids else dataclasses.replace(b, position_ids=None)
        if self.config.model.dropout_rng == "position":
            if index is None:
                raise ValueError("position-keyed dropout needs each sample's index in the dataset: the loader's "
                                 "batches carry it as 'index' (build_pretraining_data_loader)")
            b = dataclasses.replace(b, dropout_keys=sample_keys(self.config.seed, to_device(index, self.device)))
        if self.groups.cp_size > 1:
            s = b.tokens.size(1)
            if s not in self._cp_contexts:  # the layout depends on the length only: built once, not per micro-batch
                p = self.config.parallel
                self._cp_contexts[s] = context_parallel_context(s, self.groups, p.cp_comm_type, self.device,
                                                                hierarchical=p.hierarchical_cp)
            documents = document_bounds(text, eod) if d.reset_attention_mask else None  # host tokens: no sync
            return split_for_context_parallel(b, self._cp_contexts[s], documents)
        return b

    def _local_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean micro-batch loss (0 elsewhere), on the device."""
        if self.is_last_stage and losses:
            return torch.stack([x.double() for x in losses]).mean()
        return torch.zeros((), dtype=torch.float64, device=self.device)

    def train_step(self, batches: list[dict], eod: Optional[int],
                   lap: Optional[Callable[[str], None]] = None) -> tuple[torch.Tensor, bool]:
        """One iteration over the loader's ``batches``: ``(local loss on the device, updated)``."""
        if self.config.model.num_experts:  # the routers' losses are scaled in backward as the LM loss is
            for chunk in self.chunks:
                chunk.moe_aux.value = self.engine.loss_scaler.scale / len(batches)
                chunk.moe_aux.take()
        micro_batches = [self.micro_batch(b["text"], eod, b.get("index")) for b in batches]
        losses, updated = self.stage.train_step(micro_batches, lap)
        if self.config.model.moe_router_enable_expert_bias:
            self._update_expert_biases(updated)
        loss = self._local_mean(losses)
        return (torch.cat([loss.view(1), self._moe_stats(len(batches))]) if self.config.model.num_experts
                else loss), updated

    def _update_expert_biases(self, updated: bool) -> None:
        """Once per step: every router's bias from its experts' token copies over the whole global batch
        (summed over data x context ranks in one all-reduce; TP ranks counted the same gathered tokens)."""
        routers = [m for chunk in self.chunks for m in chunk.modules() if isinstance(m, Router)]
        if not routers:
            return
        counts = torch.stack([r.tokens_per_expert for r in routers])
        if self.groups.dp_size * self.groups.cp_size > 1:
            dist.all_reduce(counts, group=self.groups.dp_cp_group)
        for router, c in zip(routers, counts):
            if updated:  # a skipped step (overflow) leaves the biases as they were
                router.update_expert_bias(c, self.config.model.moe_router_bias_update_rate)
            router.tokens_per_expert.zero_()

    def _moe_stats(self, micro_batches: int) -> torch.Tensor:
        """``[aux losses per micro-batch, sum of expert loads, their count, sum of dropped shares]`` of this
        rank's layers, on the device; summed over the stages and averaged over DP with the loss, they give
        the logged figures."""
        aux, loads, dropped = [], [], []
        for chunk in self.chunks:
            a, l_, d = chunk.moe_aux.take()
            aux += a
            loads += l_
            dropped += d
        dev = self.device
        total = torch.stack(aux).sum().double() / micro_batches if aux else torch.zeros((), dtype=torch.float64, device=dev)
        if aux and self.groups.tp_size > 1 and self.config.model.sequence_parallel:
            dist.all_reduce(total, group=self.groups.tp_group)  # each TP rank routed its own tokens: shares
        def summed(values):
            return torch.stack(values).sum().double().to(dev) if values else torch.zeros((), dtype=torch.float64,
                                                                                          device=dev)

        layers = torch.tensor(float(len(loads)), dtype=torch.float64, device=dev)
        return torch.stack([total.to(dev), summed(loads), layers, summed(dropped)])

    @torch.no_grad()
    def eval_step(self, batches: list[dict], eod: Optional[int]) -> torch.Tensor:
        """Forward only through the pipeline: the local mean loss on the device."""
        self.engine.eval()
        try:
            losses = self.stage.forward_only([self.micro_batch(b["text"], eod, b.get("index")) for b in batches])
        finally:
            self.engine.train()
        return self._local_mean(losses)


class LossLog:
    """Per-iteration losses kept on the device until they are needed on the host.

    ``reduce`` turns local losses (the last pipeline stage's; 0 elsewhere) into the DP mean on
    every rank: one all-reduce over PP and one over DP for any number of iterations, then one
    host synchronisation. Every rank calls it at the same iterations.
    """

    def __init__(self, groups) -> None:
        self.groups = groups
        self.pending: list[tuple[int, torch.Tensor]] = []

    def add(self, iteration: int, local: torch.Tensor) -> None:
        self.pending.append((iteration, local))

    def reduce(self, values: list[torch.Tensor]) -> list[float]:
        if not values:
            return []
        t = torch.stack(values).to(torch.float64)
        g = self.groups
        if g.pp_size > 1:
            dist.all_reduce(t, group=g.pp_group)  # only the last stage's are non-zero
        # Context-parallel ranks hold shares of one sample's mean: summed with the data-parallel means.
        if g.dp_size * g.cp_size > 1:
            dist.all_reduce(t, group=g.dp_cp_group if g.cp_size > 1 else g.dp_group)
        return (t / g.dp_size).tolist()

    def flush(self) -> dict[int, float]:
        """Every pending iteration's DP-mean loss (``{iteration: loss}``); empties the log."""
        pending, self.pending = self.pending, []
        return dict(zip([i for i, _ in pending], self.reduce([t for _, t in pending])))
