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

from megazero import zero
from megazero.data import GPTBatch, build_batch, masked_mean, to_device
from megazero.model.attention.cp_context import ContextParallel
from megazero.model.attention.cp_input import context_parallel_context, document_bounds, prepare_context_parallel_input
from megazero.model.gpt import finish_step, step_metrics
from megazero.model.keyed_dropout import sample_keys
from megazero.model.moe.layer import Router, is_expert_parameter
from megazero.model.mtp import multi_token_targets
from megazero.model.pipeline_split import build_pipeline_model, global_name_fn
from megazero.pipeline import PipelineStage
from megazero.training.qk_clip import QKClip
from megazero.config.train_config import TrainConfig

__all__ = ["TrainModel", "LossLog", "ModelBatch", "megatron_no_weight_decay"]


def megatron_no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    """Megatron's rule: biases and normalization weights (1-D) train without weight decay."""
    return param.dim() == 1 or name.endswith(".bias")


def _loss(per_token: torch.Tensor, mb) -> torch.Tensor:
    """Megatron's loss_func: the mean per-token loss over the micro-batch's loss mask. Under context
    parallelism this rank's share of it: its tokens' sum over the whole sequence's count, so the
    shares of the context-parallel ranks add up to the mean, once."""
    if getattr(mb, "loss_tokens", None) is not None:
        return (per_token.float() * mb.loss_mask.float()).sum() / mb.loss_tokens.clamp_min(1.0)
    return masked_mean(per_token, mb.loss_mask)


@dataclasses.dataclass
class ModelBatch(GPTBatch):
    """A micro-batch as this rank's model takes it: under context parallelism its tokens of every
    per-token tensor, the attention's context and the loss mask's sum over the whole sequence (every CP
    rank reads the whole sample, so it needs no collective); with multi-token prediction the targets
    and masks of every depth ``[D, b, s(_local)]`` and their counts ``[D]`` over the whole sequences."""

    context_parallel: Optional[ContextParallel] = None
    loss_tokens: Optional[torch.Tensor] = None
    mtp_targets: Optional[torch.Tensor] = None
    mtp_mask: Optional[torch.Tensor] = None
    mtp_tokens: Optional[torch.Tensor] = None


def split_for_context_parallel(b: ModelBatch, ctx: ContextParallel,
                               documents: Optional[list[list[int]]] = None) -> ModelBatch:
    """This rank's share of ``b`` under ``ctx`` (the model's
    :func:`~megazero.model.attention.cp_input.prepare_context_parallel_input`)."""
    names = ("tokens", "labels", "loss_mask", "mtp_targets", "mtp_mask")
    ctx, local, positions, mask = prepare_context_parallel_input(
        ctx, {n: getattr(b, n) for n in names}, b.position_ids, b.attention_mask, documents)
    return dataclasses.replace(b, **local, position_ids=positions, attention_mask=mask, context_parallel=ctx,
                               loss_tokens=b.loss_mask.float().sum())


def expert_partitioning(groups):
    """ZeRO's partitioning of the experts under expert (tensor) parallelism: each expert shard over the
    ranks that hold it (expert data parallel); every other parameter over data x context (None: the
    default)."""
    if groups.ep_size == 1 and groups.etp_size == groups.tp_size:
        return None
    edp = zero.Partitioning("edp", shard=groups.edp_group)
    return lambda name, param: edp if is_expert_parameter(param) else None


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
        o = config.optim
        self.qk_clip: Optional[QKClip] = None  # --qk-clip / --log-max-attention-logit
        if o.qk_clip or o.log_max_attention_logit:
            self.qk_clip = QKClip(list(self.chunks), clip=o.qk_clip, threshold=o.qk_clip_threshold,
                                  alpha=o.qk_clip_alpha)
            self.engine.after_update.append(self.qk_clip)
        self._cp_contexts: dict[int, ContextParallel] = {}  # sequence length -> this rank's CP context
        self.stage = PipelineStage(self.engine, self.chunks, groups, micro_batch_size=config.schedule.micro_batch_size,
                                   seq_length=config.model.seq_length, loss_fn=_loss)

    @property
    def is_last_stage(self) -> bool:
        return self.stage.is_last_stage

    def micro_batch(self, text: torch.Tensor, eod: Optional[int], index: Optional[torch.Tensor] = None) -> ModelBatch:
        """Megatron's get_batch: inputs, labels, loss mask, positions and attention mask of a micro-batch;
        with position-keyed dropout also the samples' keys, from their dataset ``index`` (the loader's);
        with multi-token prediction its targets; under context parallelism this rank's tokens of them."""
        d = self.config.data
        # The ring takes each sample's documents as cut points, not as an [s, s] mask (16 GiB at 128K tokens).
        kinds = set(self.config.parallel.cp_comm_types) if self.groups.cp_size > 1 else set()
        ring_only = bool(kinds) and not kinds & {"a2a", "allgather"}
        b = build_batch(to_device(text, self.device), eod, d.reset_position_ids,
                        d.reset_attention_mask and not ring_only, d.eod_mask_loss)
        b = ModelBatch(**{f.name: getattr(b, f.name) for f in dataclasses.fields(b)})
        # Plain positions and plain causality are the model's defaults: passing nothing keeps flash attention usable.
        b = b if d.reset_position_ids else dataclasses.replace(b, position_ids=None)
        if self.config.model.mtp_num_layers:
            b = self._with_mtp_targets(b, eod)
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

    def _with_mtp_targets(self, b: ModelBatch, eod: Optional[int]) -> ModelBatch:
        """Multi-token prediction's targets of the whole sequences (before any context-parallel split):
        never across a packed document's end with --reset-attention-mask."""
        docs = None
        if self.config.data.reset_attention_mask and eod is not None:
            is_eod = (b.tokens == eod).long()
            docs = torch.cumsum(is_eod, dim=1) - is_eod  # a document ends after its EOD token
        targets, mask = multi_token_targets(b.labels, b.loss_mask, self.config.model.mtp_num_layers, docs)
        return dataclasses.replace(b, mtp_targets=targets, mtp_mask=mask, mtp_tokens=mask.sum(dim=(1, 2)))

    def _local_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean micro-batch loss (0 elsewhere), on the device."""
        if self.is_last_stage and losses:
            return torch.stack([x.double() for x in losses]).mean()
        return torch.zeros((), dtype=torch.float64, device=self.device)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The names of what :meth:`train_step` returns, the same on every rank (the log's collective)."""
        c = self.config.model
        moe = ("moe aux loss", "expert load sum", "moe layers", "moe dropped sum") if c.num_experts else ()
        return ("lm loss",) + moe + tuple(f"mtp_{k} loss" for k in range(1, c.mtp_num_layers + 1))

    def train_step(self, batches: list[dict], eod: Optional[int],
                   lap: Optional[Callable[[str], None]] = None) -> tuple[dict[str, torch.Tensor], bool]:
        """One iteration over the loader's ``batches``: ``({name: this rank's figure on the device}, updated)``
        with the names of :attr:`metric_names` (each summed over the stages and averaged over data-parallel
        ranks when the log reduces them)."""
        micro_batches = [self.micro_batch(b["text"], eod, b.get("index")) for b in batches]
        self._prepare_chunks(micro_batches)
        losses, updated = self.stage.train_step(micro_batches, lap)
        finish_step(self.chunks, updated, self.groups.dp_cp_group if self.groups.dp_cp_size > 1 else None)
        metrics = {name: torch.zeros((), dtype=torch.float64, device=self.device) for name in self.metric_names}
        metrics["lm loss"] = self._local_mean(losses)
        metrics.update(step_metrics(self.chunks, len(batches), self.device))
        return metrics, updated

    def _prepare_chunks(self, micro_batches: list[ModelBatch]) -> None:
        """Each chunk's factors for this step: the routers' losses are scaled in backward as the LM loss is,
        and multi-token prediction's loss is normalised by its targets' count over the whole global batch
        (one all-reduce of D numbers over the data-parallel ranks)."""
        scale, m = self.engine.loss_scaler.scale, len(micro_batches)
        counts = None
        if self.config.model.mtp_num_layers and self.is_last_stage:
            counts = torch.stack([mb.mtp_tokens for mb in micro_batches]).sum(0)
            if self.groups.dp_size > 1:  # context-parallel ranks counted the same whole samples
                dist.all_reduce(counts, group=self.groups.dp_group)
        for chunk in self.chunks:
            chunk.prepare_step(scale, m, counts, data_parallel_size=self.groups.dp_size)

    @torch.no_grad()
    def eval_step(self, batches: list[dict], eod: Optional[int]) -> dict[str, torch.Tensor]:
        """Forward only through the pipeline: ``{'lm loss': the local mean loss on the device}``."""
        self.engine.eval()
        try:
            losses = self.stage.forward_only([self.micro_batch(b["text"], eod, b.get("index")) for b in batches])
        finally:
            self.engine.train()
        return {"lm loss": self._local_mean(losses)}


class LossLog:
    """Per-iteration figures kept on the device until they are needed on the host.

    ``reduce`` turns each iteration's local figures (``{name: 0-d tensor}``: the last pipeline stage's
    loss, 0 elsewhere; each stage's statistics) into their sum over the stages and their DP mean, on every
    rank: one all-reduce over PP and one over DP for any number of iterations, then one host
    synchronisation. Every rank calls it at the same iterations with the same names.
    """

    def __init__(self, groups) -> None:
        self.groups = groups
        self.pending: list[tuple[int, dict[str, torch.Tensor]]] = []

    def add(self, iteration: int, local: dict[str, torch.Tensor]) -> None:
        self.pending.append((iteration, local))

    def reduce(self, values: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
        if not values:
            return []
        names = list(values[0])
        t = torch.stack([torch.stack([v[n].to(torch.float64) for n in names]) for v in values])
        g = self.groups
        if g.pp_size > 1:
            dist.all_reduce(t, group=g.pp_group)  # only the last stage's losses are non-zero
        # Context-parallel ranks hold shares of one sample's mean: summed with the data-parallel means.
        if g.dp_size * g.cp_size > 1:
            dist.all_reduce(t, group=g.dp_cp_group if g.cp_size > 1 else g.dp_group)
        return [dict(zip(names, row)) for row in (t / g.dp_size).tolist()]

    def flush(self) -> dict[int, dict[str, float]]:
        """Every pending iteration's figures (``{iteration: {name: value}}``); empties the log."""
        pending, self.pending = self.pending, []
        return dict(zip([i for i, _ in pending], self.reduce([t for _, t in pending])))
