"""The model as a training loop sees it: one rank's chunks, its inputs from a batch, its step hooks.

:class:`ModelFace` is what the training side holds of the GPT. It builds this rank's model chunks for a
layout (on the meta device, for ZeRO to materialize), turns the loader's micro-batch into this rank's
model inputs (:class:`ModelBatch`: the context-parallel split with its per-length context, the packed
documents, the keyed-dropout keys, the multi-token targets), scales the step's side losses before the
forwards, ends the step (the routers' expert biases) and reports the step's figures by the names of
:mod:`~megazero.model.metrics`. The loop never spells a layer, a router or a CP context.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable, Optional, Union

import torch
import torch.distributed as dist

from .attention.cp.input import context_parallel_context, document_bounds, prepare_context_parallel_input
from .config import GPTConfig
from .keyed_dropout import sample_keys
from .metrics import LM_LOSS, metric_names, step_metrics
from .moe.layer import Router, is_expert_parameter
from .mtp import multi_token_targets
from .pipeline_split import build_pipeline_model, global_name_fn

if TYPE_CHECKING:  # made by cp/input.py, held and handed on
    from .attention.cp.context import ContextParallel

__all__ = ["ModelFace", "ModelBatch", "split_for_context_parallel"]


@dataclasses.dataclass
class ModelBatch:
    """A micro-batch as this rank's model takes it: the fields of ``megazero.data.GPTBatch`` (same names,
    same order); under context parallelism its tokens of every per-token tensor, the attention's context
    and the loss mask's sum over the whole sequence (every CP rank reads the whole sample, so it needs no
    collective); with multi-token prediction the targets and masks of every depth ``[D, b, s(_local)]`` and
    their counts ``[D]`` over the whole sequences."""

    tokens: torch.Tensor  # [b, s] int64 inputs
    labels: torch.Tensor  # [b, s] int64 next tokens
    loss_mask: torch.Tensor  # [b, s] float32, 0 where no loss is taken
    position_ids: Optional[torch.Tensor]  # [b, s] int64; None: plain positions 0..s-1
    attention_mask: Optional[torch.Tensor]  # [b, 1, s, s] bool, True = masked; None = plain causal
    dropout_keys: Optional[torch.Tensor] = None  # [b] int64 samples' keys of position-keyed dropout
    context_parallel: Optional[ContextParallel] = None
    loss_tokens: Optional[torch.Tensor] = None
    mtp_targets: Optional[torch.Tensor] = None
    mtp_mask: Optional[torch.Tensor] = None
    mtp_tokens: Optional[torch.Tensor] = None


def split_for_context_parallel(b: ModelBatch, ctx: ContextParallel, documents: Optional[list[list[int]]] = None,
                               balance_documents: bool = True) -> ModelBatch:
    """This rank's share of ``b`` under ``ctx``
    (:func:`~megazero.model.attention.cp.input.prepare_context_parallel_input`)."""
    names = ("tokens", "labels", "loss_mask", "mtp_targets", "mtp_mask")
    ctx, local, positions, mask = prepare_context_parallel_input(
        ctx, {n: getattr(b, n) for n in names}, b.position_ids, b.attention_mask, documents, balance_documents)
    return dataclasses.replace(b, **local, position_ids=positions, attention_mask=mask, context_parallel=ctx,
                               loss_tokens=b.loss_mask.float().sum())


def _chunk_index(args: tuple, kwargs: dict) -> int:
    """Which virtual chunk a call of :class:`~megazero.model.pipeline_split.StageChunks` runs."""
    return args[0]


class ModelFace:
    """This rank's GPT for ``groups`` (a :class:`megazero.mpu.ParallelGroups`), as the training side uses it.

    ``first`` / ``last``: the first and last pipeline stages' layers (uneven splits); ``seed``: the run's,
    which keys position-keyed dropout; ``cp_comm_type`` (one kind or one per layer) and ``hierarchical_cp``:
    the context-parallel exchanges; ``reset_position_ids`` / ``reset_attention_mask``: the loader's
    batches restart positions / attention at each packed document.
    """

    is_expert_parameter = staticmethod(is_expert_parameter)

    def __init__(self, config: GPTConfig, groups, device: torch.device, *, seed: int, first: Optional[int] = None,
                 last: Optional[int] = None, cp_comm_type: Union[str, tuple[str, ...]] = "p2p",
                 hierarchical_cp: tuple[int, ...] = (), reset_position_ids: bool = False,
                 reset_attention_mask: bool = False) -> None:
        self.config, self.groups, self.device, self.seed = config, groups, device, seed
        self.cp_comm_type, self.hierarchical_cp = cp_comm_type, hierarchical_cp
        self.reset_position_ids, self.reset_attention_mask = reset_position_ids, reset_attention_mask
        # Built on the meta device: every ZeRO stage materializes it partition by partition,
        # with values keyed by the pp = 1 names (equal to a full initialization at any layout).
        self.module, self.chunks = build_pipeline_model(config, groups, first=first, last=last, device="meta")
        for router in (m for m in self.module.modules() if isinstance(m, Router) and hasattr(m, "expert_bias")):
            router.place_buffers(device)
        self._cp_contexts: dict[int, ContextParallel] = {}  # sequence length -> this rank's CP context
        self._recurrent = config.recurrent  # state passing needs one placement of the tokens for every sample

    @property
    def param_names(self) -> Callable[[str], str]:
        """A parameter's name in :attr:`module` -> its name at pp = 1 (initialization and checkpoints)."""
        return global_name_fn(self.chunks)

    @property
    def forward_key(self) -> Optional[Callable[[tuple, dict], int]]:
        """Which chunk a call of :attr:`module` runs (``forward(chunk, ...)`` with several chunks), else None."""
        return _chunk_index if len(self.chunks) > 1 else None

    @property
    def document_mask(self) -> bool:
        """Whether the loader's batch carries the per-document attention mask ``[b, 1, s, s]``: with
        ``reset_attention_mask``, unless every context-parallel exchange is a ring, which takes each sample's
        documents as cut points instead (the mask is 16 GiB at 128K tokens)."""
        kinds = (self.cp_comm_type,) if isinstance(self.cp_comm_type, str) else tuple(self.cp_comm_type)
        kinds = set(kinds) if self.groups.cp_size > 1 else set()
        ring_only = bool(kinds) and not kinds & {"a2a", "allgather"}
        return self.reset_attention_mask and not ring_only

    def inputs(self, batch, text: torch.Tensor, eod: Optional[int],
               index: Optional[torch.Tensor] = None) -> ModelBatch:
        """This rank's model inputs from a micro-batch: ``batch`` is ``megazero.data.build_batch`` of the
        loader's ``text`` (on the device, with the mask :attr:`document_mask` asks for), ``text`` the loader's
        host tokens ``[b, s + 1]``, ``index`` the samples' indices in the dataset (the loader's), which key
        position-keyed dropout. Adds multi-token targets of the whole sequences, then under context
        parallelism keeps this rank's tokens of everything."""
        b = ModelBatch(**{f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)})
        # Plain positions and plain causality are the model's defaults: passing nothing keeps flash attention usable.
        b = b if self.reset_position_ids else dataclasses.replace(b, position_ids=None)
        if self.config.mtp_num_layers:
            b = self._with_mtp_targets(b, eod)
        if self.config.dropout_rng == "position":
            if index is None:
                raise ValueError("position-keyed dropout needs each sample's index in the dataset: the loader's "
                                 "batches carry it as 'index' (build_pretraining_data_loader)")
            # as megazero.data.to_device: asynchronous from pinned memory, ordered before the kernels reading it
            index = index.to(self.device, non_blocking=torch.device(self.device).type == "cuda")
            b = dataclasses.replace(b, dropout_keys=sample_keys(self.seed, index))
        if self.groups.cp_size > 1:
            s = b.tokens.size(1)
            if s not in self._cp_contexts:  # the layout depends on the length only: built once, not per micro-batch
                self._cp_contexts[s] = context_parallel_context(s, self.groups, self.cp_comm_type, self.device,
                                                                hierarchical=self.hierarchical_cp)
            documents = document_bounds(text, eod) if self.reset_attention_mask else None  # host tokens: no sync
            return split_for_context_parallel(b, self._cp_contexts[s], documents, not self._recurrent)
        return b

    def _with_mtp_targets(self, b: ModelBatch, eod: Optional[int]) -> ModelBatch:
        """Multi-token prediction's targets of the whole sequences (before any context-parallel split):
        never across a packed document's end with ``reset_attention_mask``."""
        docs = None
        if self.reset_attention_mask and eod is not None:
            is_eod = (b.tokens == eod).long()
            docs = torch.cumsum(is_eod, dim=1) - is_eod  # a document ends after its EOD token
        targets, mask = multi_token_targets(b.labels, b.loss_mask, self.config.mtp_num_layers, docs)
        return dataclasses.replace(b, mtp_targets=targets, mtp_mask=mask, mtp_tokens=mask.sum(dim=(1, 2)))

    def prepare_step(self, micro_batches: list[ModelBatch], loss_scale: float) -> None:
        """Each chunk's factors for a step over ``micro_batches`` whose LM loss is scaled by ``loss_scale``
        in backward: the routers' losses are scaled as the LM loss is, and multi-token prediction's loss is
        normalised by its targets' count over the whole global batch (one all-reduce of D numbers over the
        data-parallel ranks)."""
        g, m = self.groups, len(micro_batches)
        counts = None
        if self.config.mtp_num_layers and g.pp_rank == g.pp_size - 1:
            counts = torch.stack([mb.mtp_tokens for mb in micro_batches]).sum(0)
            if g.dp_size > 1:  # context-parallel ranks counted the same whole samples
                dist.all_reduce(counts, group=g.dp_group)
        for chunk in self.chunks:
            chunk.prepare_step(loss_scale, m, counts, data_parallel_size=g.dp_size)

    def finish_step(self, updated: bool) -> None:
        """After a step: every router's expert bias (DeepSeek-V3's auxiliary-loss-free balancing) moves by
        its experts' token copies over the whole global batch (summed over the data x context ranks in one
        all-reduce for all the chunks; TP ranks counted the same gathered tokens). A skipped step
        (``updated`` False) leaves the biases."""
        c = self.config
        if not c.moe_router_enable_expert_bias:
            return
        routers = [r for m in self.chunks for r in m.modules() if isinstance(r, Router)]
        if not routers:
            return
        counts = torch.stack([r.tokens_per_expert for r in routers])
        if self.groups.dp_cp_size > 1:
            dist.all_reduce(counts, group=self.groups.dp_cp_group)
        for router, n in zip(routers, counts):
            if updated:
                router.update_expert_bias(n, c.moe_router_bias_update_rate)
            router.tokens_per_expert.zero_()

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The names of what :meth:`step_metrics` returns, in order, the same on every rank."""
        return metric_names(self.config)

    def step_metrics(self, lm_loss: torch.Tensor, micro_batches: int) -> dict[str, torch.Tensor]:
        """The step's figures by :attr:`metric_names` (this rank's, on the device): ``lm_loss`` (this stage's
        mean micro-batch loss) and what this stage's chunks recorded over ``micro_batches`` forwards; a
        figure this stage holds none of is 0."""
        metrics = {name: torch.zeros((), dtype=torch.float64, device=self.device) for name in self.metric_names}
        metrics[LM_LOSS] = lm_loss
        metrics.update(step_metrics(self.chunks, micro_batches, self.device))
        return metrics
