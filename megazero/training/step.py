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

from typing import Callable, Optional

import torch
import torch.distributed as dist

from megazero import zero
from megazero.config.train_config import TrainConfig
from megazero.data import build_batch, masked_mean, to_device
from megazero.model import LM_LOSS, ModelBatch, ModelFace
from megazero.pipeline import PipelineStage
from megazero.training.qk_clip import QKClip

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


def expert_partitioning(groups):
    """ZeRO's partitioning of the experts under expert (tensor) parallelism: each expert shard over the
    ranks that hold it (expert data parallel); every other parameter over data x context (None: the
    default)."""
    if groups.ep_size == 1 and groups.etp_size == groups.tp_size:
        return None
    edp = zero.Partitioning("edp", shard=groups.edp_group)
    return lambda name, param: edp if ModelFace.is_expert_parameter(param) else None


class TrainModel:
    """This rank's chunks, their ZeRO engine and the schedule that runs them, for ``groups``."""

    def __init__(self, config: TrainConfig, groups, device: torch.device) -> None:
        p, d = config.parallel, config.data
        self.config, self.groups, self.device = config, groups, device
        self.face = ModelFace(config.model, groups, device, seed=config.seed,
                              first=p.decoder_first_pipeline_num_layers, last=p.decoder_last_pipeline_num_layers,
                              cp_comm_type=p.cp_comm_type, hierarchical_cp=p.hierarchical_cp,
                              reset_position_ids=d.reset_position_ids, reset_attention_mask=d.reset_attention_mask)
        self.chunks = self.face.chunks
        self.engine = zero.initialize(self.face.module, config.zero_config(), groups=groups,
                                      no_weight_decay=megatron_no_weight_decay, device=device,
                                      param_names=self.face.param_names, forward_key=self.face.forward_key,
                                      partitioning=expert_partitioning(groups))
        o = config.optim
        self.qk_clip: Optional[QKClip] = None  # --qk-clip / --log-max-attention-logit
        if o.qk_clip or o.log_max_attention_logit:
            self.qk_clip = QKClip(list(self.chunks), clip=o.qk_clip, threshold=o.qk_clip_threshold,
                                  alpha=o.qk_clip_alpha)
            self.engine.after_update.append(self.qk_clip)
        self.stage = PipelineStage(self.engine, self.chunks, groups, micro_batch_size=config.schedule.micro_batch_size,
                                   seq_length=config.model.seq_length, loss_fn=_loss)

    @property
    def is_last_stage(self) -> bool:
        return self.stage.is_last_stage

    def micro_batch(self, text: torch.Tensor, eod: Optional[int], index: Optional[torch.Tensor] = None) -> ModelBatch:
        """Megatron's get_batch: inputs, labels, loss mask, positions and attention mask of a micro-batch, as
        this rank's model takes them (:meth:`ModelFace.inputs`: keyed-dropout keys from the samples' dataset
        ``index``, multi-token targets, this rank's tokens under context parallelism)."""
        d = self.config.data
        b = build_batch(to_device(text, self.device), eod, d.reset_position_ids, self.face.document_mask,
                        d.eod_mask_loss)
        return self.face.inputs(b, text, eod, index)

    def _local_mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        """The last stage's mean micro-batch loss (0 elsewhere), on the device."""
        if self.is_last_stage and losses:
            return torch.stack([x.double() for x in losses]).mean()
        return torch.zeros((), dtype=torch.float64, device=self.device)

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The names of what :meth:`train_step` returns, the same on every rank (the log's collective)."""
        return self.face.metric_names

    def train_step(self, batches: list[dict], eod: Optional[int],
                   lap: Optional[Callable[[str], None]] = None) -> tuple[dict[str, torch.Tensor], bool]:
        """One iteration over the loader's ``batches``: ``({name: this rank's figure on the device}, updated)``
        with the names of :attr:`metric_names` (each summed over the stages and averaged over data-parallel
        ranks when the log reduces them)."""
        micro_batches = [self.micro_batch(b["text"], eod, b.get("index")) for b in batches]
        self.face.prepare_step(micro_batches, self.engine.loss_scaler.scale)
        losses, updated = self.stage.train_step(micro_batches, lap)
        self.face.finish_step(updated)
        return self.face.step_metrics(self._local_mean(losses), len(batches)), updated

    @torch.no_grad()
    def eval_step(self, batches: list[dict], eod: Optional[int]) -> dict[str, torch.Tensor]:
        """Forward only through the pipeline: ``{'lm loss': the local mean loss on the device}``."""
        self.engine.eval()
        try:
            losses = self.stage.forward_only([self.micro_batch(b["text"], eod, b.get("index")) for b in batches])
        finally:
            self.engine.train()
        return {LM_LOSS: self._local_mean(losses)}


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
