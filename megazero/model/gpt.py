"""GPTModel: a decoder-only transformer made of megazero.mpu layers, for any TP size.

The model takes a tensor-parallel group and nothing else about parallelism: data
parallelism and ZeRO wrap it from outside. Internally activations are
``[s, b, h]`` (Megatron's layout); sequence parallelism splits dim 0.

Initialization contract (partitioned construction relies on it): every module that
owns parameters has ``reset_parameters()`` initializing only its own parameters from
the default generator, and a freshly built model equals
``mpu.reset_parameters_in_order(model)`` after seeding. The constructor builds on the
meta device, materializes, and runs exactly that, so a model built on ``meta`` and
materialized module by module (in ``modules()`` order) gets the same numbers. With
the mpu layers drawing full master weights, the gathered weights do not depend on tp.

Vocabulary padding: the embedding has ``padded_vocab_size`` rows (TP-independent), and
logits of the padded ids (>= ``vocab_size``) are set to -inf, so they are never predicted
and the loss equals that of an unpadded model (and of the exported HF model).

Dropout: replicated activations use the default generator; attention dropout and
sequence-parallel hidden dropout use the model-parallel stream, so training with
dropout > 0 needs ``mpu.model_parallel_manual_seed(seed)`` first. With
``dropout_rng='position'`` hidden-dropout masks are keyed by (sample, token index, feature,
site) and attention-dropout masks by (sample, global head, query index, key index, layer) instead
(``keyed_dropout.py``), the same at every layout: forward then takes the samples' keys.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import mpu
from megazero.mpu.initializers import init_method_normal, initialize_sharded_

from .attention.rope import rotary_embedding
from .config import GPTConfig
from .forward_context import ForwardContext
from .init import init_methods
from .keyed_dropout import DropoutKey
from .layer_spec import ExpertParallel
from .moe.layer import AuxLossScale
from .mtp import MTPScale, MultiTokenPrediction, multi_token_targets
from .norms import build_norm
from .transformer import TransformerLayer, dropout

if TYPE_CHECKING:  # handed in with a micro-batch and passed to the layers; only its positions are read here
    from .attention.cp.context import ContextParallel
    from .decode_cache import DecodeCache

__all__ = ["GPTModel", "PositionEmbedding", "materialize_", "expert_placement"]


class PositionEmbedding(torch.nn.Module):
    """Learned absolute positions ``[max_positions, h]``, replicated over TP, N(0, std)."""

    def __init__(self, max_positions: int, hidden_size: int, std: float, *, params_dtype: torch.dtype, device=None,
                 init_method=None) -> None:
        super().__init__()
        self.std = std
        self.init_method = init_method or init_method_normal(std)
        self.weight = torch.nn.Parameter(torch.empty(max_positions, hidden_size, dtype=params_dtype, device=device))

    def reset_parameters(self) -> None:
        # Drawn on the CPU like the mpu layers, so the numbers do not depend on the device.
        initialize_sharded_(self.weight, tuple(self.weight.shape), 0, 0, 1, self.init_method)

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(position_ids, self.weight)


@torch.no_grad()
def materialize_(module: torch.nn.Module, device: torch.device | str, recurse: bool = True) -> torch.nn.Module:
    """Replace meta parameters/buffers by uninitialized ones on ``device``, keeping the
    Python attributes Megatron-style code hangs on parameters (``tensor_model_parallel``,
    ``partition_dim``, ``partition_stride``, ``sequence_parallel``...).

    ``nn.Module.to_empty`` creates fresh ``Parameter`` objects when moving off ``meta``
    and silently drops those attributes; this does not. Shared parameters stay shared.
    """
    memo: dict[int, torch.Tensor] = {}
    for m in module.modules() if recurse else [module]:
        for store in (m._parameters, m._buffers):
            for name, t in list(store.items()):
                if t is None:
                    continue
                if id(t) not in memo:
                    new = torch.empty_like(t, device=device)
                    if isinstance(t, torch.nn.Parameter):
                        new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
                    new.__dict__.update(t.__dict__)
                    memo[id(t)] = new
                store[name] = memo[id(t)]
    return module


def expert_placement(groups) -> ExpertParallel:
    """Where the experts live under ``groups`` (a :class:`megazero.mpu.ParallelGroups`): its expert-parallel
    group, and expert tensor parallelism when its size differs from the model's TP."""
    placement = ExpertParallel(groups.ep_group, groups.ep_size, groups.ep_rank)
    if groups.etp_size != groups.tp_size:
        placement = dataclasses.replace(placement, tensor_group=groups.etp_group, tensor_size=groups.etp_size,
                                        tensor_rank=groups.etp_rank, exchange_group=groups.expert_group)
    return placement


# What a micro-batch may add to a forward's inputs, passed by name when set.
_STAGE_EXTRAS = ("context_parallel", "dropout_keys", "mtp_targets", "mtp_mask")


class GPTModel(torch.nn.Module):
    """GPT over ``config`` for the TP group ``tp_group`` (default: the registered mpu group).

    ``device='meta'`` builds an allocation-free skeleton (for planning or ZeRO-3).
    """

    def __init__(self, config: GPTConfig, groups=None, *, tp_group: Optional[dist.ProcessGroup] = None,
                 device: Optional[torch.device | str] = None, pre_process: bool = True, post_process: bool = True,
                 layers: Optional[range] = None, ep_group: Optional[dist.ProcessGroup] = None,
                 expert_groups: Optional[ExpertParallel] = None) -> None:
        """Pipeline stages (Megatron's names): ``pre_process`` builds the embedding (first stage),
        ``post_process`` the final norm, head and loss (last stage), ``layers`` the global indices of
        the transformer layers this stage holds (default: all). ``groups``: the run's
        :class:`megazero.mpu.ParallelGroups`, whose tensor- and expert-parallel groups the layers are handed
        (the keyword groups below then must not be given); without it, ``tp_group`` and ``ep_group``. A last
        stage with tied embeddings or multi-token prediction and no ``pre_process`` holds a copy of the word
        embedding, marked ``pipeline_shared_copy`` (and Megatron's ``shared``) so the gradient norm counts it
        once.
        ``ep_group``: the expert-parallel group of a mixture of experts (default: the registered mpu
        group; none: this rank holds every expert); ``expert_groups`` gives every expert group at once
        (expert tensor parallelism too; its ``aux_scale`` is replaced by the model's). ``moe_aux`` scales
        the routers' auxiliary losses."""
        super().__init__()
        layers = range(config.num_layers) if layers is None else layers
        if layers.step != 1 or layers.start < 0 or layers.stop > config.num_layers:
            raise ValueError(f"layers {layers} must be a contiguous range inside 0..{config.num_layers}")
        self.pre_process, self.post_process, self.layer_range = pre_process, post_process, layers
        self._input_tensor: Optional[torch.Tensor] = None
        if groups is not None:
            if tp_group is not None or ep_group is not None or expert_groups is not None:
                raise ValueError("give GPTModel the run's groups or the single groups (tp_group, ep_group, "
                                 "expert_groups), not both")
            tp_group, expert_groups = groups.tp_group, expert_placement(groups) if config.num_experts else None
        self.tp_group = mpu.mappings.resolve_tp_group(tp_group)
        self.tp_size = mpu.utils.group_size(self.tp_group)
        self.tp_rank = mpu.utils.group_rank(self.tp_group)
        config.validate(self.tp_size)
        self.config = c = config
        self.sequence_parallel = c.sequence_parallel and self.tp_size > 1
        kw = dict(tp_group=self.tp_group, tp_size=self.tp_size, device="meta")
        std = c.init_method_std
        init, _ = init_methods(c)

        # The embedding comes first in modules() order on every stage that has one, so a last
        # stage's tied copy draws the same numbers as the first stage's embedding under one seed.
        self.embedding = (mpu.VocabParallelEmbedding(c.padded_vocab_size, c.hidden_size, init_method=init,
                                                     tp_group=self.tp_group, params_dtype=c.params_dtype, device="meta")
                          if pre_process or (post_process and (c.tie_embeddings or c.mtp_num_layers)) else None)
        if self.embedding is not None and not pre_process:
            self.embedding.weight.pipeline_shared_copy = True
            self.embedding.weight.shared = True  # Megatron's name (param_is_not_shared)
        self.position_embeddings = (PositionEmbedding(c.max_position_embeddings, c.hidden_size, std,
                                                      params_dtype=c.params_dtype, device="meta", init_method=init)
                                    if c.position_embedding_type == "learned" and pre_process else None)
        self.rotary = rotary_embedding(c) if c.position_embedding_type == "rope" else None
        self.moe_aux = AuxLossScale()
        self._recurrent = c.recurrent  # some layer carries a state along the sequence: it needs document starts
        experts = self._expert_placement(ep_group, expert_groups)
        self.layers = torch.nn.ModuleList(TransformerLayer(c, number=i, experts=experts, **kw) for i in layers)
        self.final_norm = build_norm(c, **kw) if post_process else None
        # Tied: the output layer owns no weight and is handed the embedding's (Megatron-core's way).
        self.output_layer = (mpu.ColumnParallelLinear(
            c.hidden_size, c.padded_vocab_size, bias=False, gather_output=False, init_method=init,
            sequence_parallel=c.sequence_parallel, tp_group=self.tp_group, params_dtype=c.params_dtype, device="meta",
            skip_weight_param_allocation=c.tie_embeddings) if post_process else None)
        # Multi-token prediction after the last layer, sharing the embedding (a copy on a later stage) and head.
        self.mtp = (MultiTokenPrediction(c, first_number=c.num_layers, device="meta", experts=experts,
                                         tp_group=self.tp_group, tp_size=self.tp_size)
                    if post_process and c.mtp_num_layers else None)

        # Padded vocabulary entries (ids >= vocab_size) are never predicted: their logits are -inf.
        per_rank = c.padded_vocab_size // self.tp_size
        self._first_padded_col = min(max(c.vocab_size - self.tp_rank * per_rank, 0), per_rank)

        if device is None or torch.device(device).type != "meta":
            materialize_(self, device if device is not None else "cpu")
            mpu.reset_parameters_in_order(self)

    # ---- the step's hooks ---------------------------------------------------------------------

    def prepare_step(self, loss_scale: float, micro_batches: int, mtp_tokens: Optional[torch.Tensor] = None,
                     data_parallel_size: int = 1) -> None:
        """Before a step's forwards, whose LM loss is scaled by ``loss_scale / micro_batches`` in backward:
        the routers' losses get that factor too. ``mtp_tokens`` ``[D]``: the count of multi-token targets of
        each depth over the whole global batch (every data-parallel rank's micro-batches), by which the MTP
        loss is normalised; gradients are averaged over ``data_parallel_size`` ranks."""
        aux = loss_scale / micro_batches
        self.moe_aux.value = aux
        self.moe_aux.take()
        if self.mtp is not None:
            scale = MTPScale()
            if mtp_tokens is not None:
                log = data_parallel_size / mtp_tokens.double().clamp_min(1.0)
                factor = self.config.mtp_loss_scaling_factor / self.config.mtp_num_layers
                scale = MTPScale(log=log, grad=(log * (factor * loss_scale)).float())
            self.mtp.set_scale(scale, aux)

    # ---- as a pipeline stage (megazero.pipeline's StageModel) --------------------------------

    def stage_activation(self, micro_batch_size: int, seq_length: int, groups,
                         compute_dtype: Optional[torch.dtype] = None) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the hidden states sent between stages for ``micro_batch_size`` sequences of
        ``seq_length`` tokens under ``groups``: ``[s(/cp)(/tp under SP), b, h]``, the residual stream's dtype
        (fp32 under ``fp32_residual_connection``, else ``compute_dtype``, default the parameters')."""
        c = self.config
        sp = c.sequence_parallel and groups.tp_size > 1
        local = seq_length // getattr(groups, "cp_size", 1)  # context parallelism: this rank's tokens
        shape = (local // groups.tp_size if sp else local, micro_batch_size, c.hidden_size)
        dtype = torch.float32 if c.fp32_residual_connection else \
            compute_dtype if compute_dtype is not None else c.params_dtype
        return shape, dtype

    def shared_embedding(self) -> Optional[torch.nn.Parameter]:
        """The word embedding this stage shares with the other end of the pipeline (the tied head's, or
        multi-token prediction's inputs): the first stage's own or the last stage's copy; None without."""
        c = self.config
        if not (c.tie_embeddings or c.mtp_num_layers) or self.embedding is None:
            return None
        return self.embedding.weight

    def stage_inputs(self, micro_batch: Any, *, first: bool, last: bool) -> tuple[tuple, dict[str, Any]]:
        """The arguments of :meth:`forward` for ``micro_batch`` (``(input_ids, labels)`` or a
        :class:`~megazero.model.face.ModelBatch`): the tokens on the ``first`` stage, the labels on the
        ``last``, positions and masks everywhere; context parallelism, keyed dropout and multi-token targets
        only when set, so a micro-batch without them runs a model that takes none."""
        if isinstance(micro_batch, (tuple, list)):
            tokens, labels, position_ids, attention_mask = micro_batch[0], micro_batch[1], None, None
        else:
            tokens, labels = micro_batch.tokens, micro_batch.labels
            position_ids = getattr(micro_batch, "position_ids", None)
            attention_mask = getattr(micro_batch, "attention_mask", None)
        extra = {name: getattr(micro_batch, name) for name in _STAGE_EXTRAS
                 if getattr(micro_batch, name, None) is not None}
        return (tokens if first else None,), dict(position_ids=position_ids, attention_mask=attention_mask,
                                                   labels=labels if last else None, **extra)

    # ---- forward ---------------------------------------------------------------------------

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """Hidden states ``[s(/tp), b, h]`` from the previous stage for the next forward (no ``pre_process``)."""
        self._input_tensor = input_tensor

    def _expert_placement(self, ep_group, given: Optional[ExpertParallel]) -> ExpertParallel:
        """Where this model's experts live: ``given``, else ``ep_group``, else the registered mpu groups."""
        if given is not None:
            return dataclasses.replace(given, aux_scale=self.moe_aux)
        registered = self.config.num_experts and mpu.model_parallel_is_initialized()
        if ep_group is None and registered:
            return dataclasses.replace(expert_placement(mpu.get_parallel_groups()), aux_scale=self.moe_aux)
        return ExpertParallel(ep_group, mpu.utils.group_size(ep_group) if ep_group is not None else 1,
                              mpu.utils.group_rank(ep_group) if ep_group is not None else 0, self.moe_aux)

    def forward(self, input_ids: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                attention_mask: Optional[torch.Tensor] = None, labels: Optional[torch.Tensor] = None,
                context_parallel: Optional[ContextParallel] = None,
                dropout_keys: Optional[torch.Tensor] = None, mtp_targets: Optional[torch.Tensor] = None,
                mtp_mask: Optional[torch.Tensor] = None, cache: Optional[DecodeCache] = None) -> torch.Tensor:
        """``input_ids`` ``[b, s]`` -> per-token fp32 loss ``[b, s]`` if ``labels`` (``-100`` = ignored),
        else this rank's vocab-parallel logits ``[b, s, padded_vocab/tp]``.

        ``position_ids``: ``[s]`` or ``[b, s]``, default ``0..s-1``. ``attention_mask``: optional
        boolean ``[b, 1, s, s]`` or ``[s, s]``, True = masked out, on top of the causal mask.
        ``context_parallel``: this rank holds some tokens of each sequence (``input_ids``, ``labels``
        and ``position_ids``, which must then be given: the tokens' global positions) and attention
        runs over the whole sequence (``cp/exchanges.py``); ``attention_mask`` is then the whole
        sequence's, in global order. ``dropout_keys``: the samples' keys (``dropout_rng='position'``), which key
        the hidden and attention dropout masks by position. ``mtp_targets`` / ``mtp_mask`` ``[D, b, s]``:
        multi-token prediction's targets (:func:`~megazero.model.mtp.multi_token_targets` of the whole
        sequence, then this rank's tokens); in training without them they are made from ``labels`` (one
        document, one process). The MTP loss reaches the gradients in backward and the log through
        :func:`~megazero.model.metrics.step_metrics`; the output stays the per-token LM loss.
        ``cache``: incremental decoding (:mod:`~megazero.model.decode_cache`): ``input_ids`` are the tokens after
        the ones the cache has seen, at positions from its length on (the default ``position_ids``); each layer
        reads and extends its entry and the cache counts them (one whole model, no context parallelism, no
        sequence parallelism, no explicit mask; :meth:`decode_cache_refusal` says when it cannot run).
        """
        mtp = (mtp_targets, mtp_mask)
        if context_parallel is not None:
            _check_context_parallel(position_ids)
        if cache is not None:
            self._check_cache(attention_mask, context_parallel)
        c = self.config
        if not self.pre_process:
            return self._stage_forward(position_ids, attention_mask, labels, context_parallel, dropout_keys, mtp)
        b, s = input_ids.shape
        seen = cache.length if cache is not None else 0
        if c.position_embedding_type == "learned" and seen + s > c.max_position_embeddings:
            raise ValueError(f"sequence length {seen + s} exceeds max_position_embeddings ({c.max_position_embeddings})")
        if self.sequence_parallel and s % self.tp_size:
            raise ValueError(f"sequence parallelism needs the sequence length ({s}) divisible by tp ({self.tp_size})")
        if position_ids is None:
            position_ids = torch.arange(seen, seen + s, device=input_ids.device)

        x = self.embedding(input_ids)  # [b, s, h]
        if self.position_embeddings is not None:
            x = x + self.position_embeddings(position_ids)
        if c.fp32_residual_connection:
            x = x.float()
        x = x.transpose(0, 1).contiguous()  # [s, b, h]
        if self.sequence_parallel:
            x = mpu.scatter_to_sequence_parallel_region(x, self.tp_group)  # [s/tp, b, h]
        key = self._dropout_key(x, dropout_keys, context_parallel)
        x = dropout(x, c.hidden_dropout, self.training, self.sequence_parallel, key, site=0)
        rotary = self.rotary(position_ids) if self.rotary is not None else None

        starts = self._document_starts(attention_mask, context_parallel, b, s)
        context = ForwardContext(rotary, attention_mask, context_parallel, key, starts, cache)
        x = self._run_layers(x, context)
        if cache is not None:
            cache.advance(s)
        if not self.post_process:
            return x  # [s(/tp), b, h] for the next pipeline stage
        return self._head(x, labels, context, mtp)

    def decode_cache_refusal(self) -> Optional[str]:
        """Why this model cannot decode with a :class:`~megazero.model.decode_cache.DecodeCache` (None: it can):
        it must hold every layer, the embedding and the head (no pipeline stages), and run without sequence
        parallelism (a decoding step has one token). Tensor parallelism is fine: each rank caches its heads."""
        if not (self.pre_process and self.post_process) or len(self.layer_range) != self.config.num_layers:
            return "the model is one pipeline stage (pre_process/post_process/layers): decode with the whole model"
        if self.sequence_parallel:
            return ("sequence parallelism splits the tokens over the TP ranks, and a decoding step has one: build the "
                    "model with sequence_parallel=False for generation (the weights are the same)")
        return None

    def _check_cache(self, attention_mask: Optional[torch.Tensor], cp: Optional[ContextParallel]) -> None:
        """Refuse a decoding cache with what it cannot take, saying why."""
        refusal = self.decode_cache_refusal()
        if refusal is not None:
            raise ValueError(f"cannot decode with a cache: {refusal}")
        if attention_mask is not None or cp is not None:
            raise ValueError("a decoding cache takes the tokens of one sequence per sample, in order: no explicit "
                             "attention_mask (packed documents) and no context parallelism")

    def _document_starts(self, mask: Optional[torch.Tensor], cp: Optional[ContextParallel], b: int,
                         s: int) -> Optional[torch.Tensor]:
        """``[b, s_local]`` bool, where this rank's tokens begin a packed document, for the recurrent layers (None
        without them or without documents): the context-parallel context's, else read off the explicit mask
        (token t begins one when it may not see token t - 1)."""
        if not self._recurrent:
            return None
        if cp is not None:
            if mask is not None and cp.starts is None:
                raise ValueError("recurrent layers under context parallelism take packed documents from the batch's "
                                 "cu_seqlens (ModelFace.inputs with reset_attention_mask), not from an attention mask")
            return cp.starts
        if mask is None:
            return None
        mask = mask.reshape(-1, mask.size(-2), mask.size(-1))  # [b or 1, s, s]
        t = torch.arange(1, mask.size(-1), device=mask.device)
        starts = torch.ones(mask.size(0), mask.size(-1), dtype=torch.bool, device=mask.device)
        starts[:, 1:] = mask[:, t, t - 1]
        return starts.expand(b, -1)

    def _dropout_key(self, x: torch.Tensor, keys: Optional[torch.Tensor],
                     cp: Optional[ContextParallel]) -> Optional[DropoutKey]:
        """The forward's keyed-dropout key for activations ``x`` ``[rows, b, h]`` (None when not keyed)."""
        c = self.config
        if c.dropout_rng != "position" or not self.training or (c.hidden_dropout == 0 and c.attention_dropout == 0):
            return None
        if keys is None:
            raise ValueError("position-keyed dropout (dropout_rng='position') needs dropout_keys: the samples' "
                             "keys (keyed_dropout.sample_keys(seed, sample indices)) for each forward in training")
        n = x.size(0) * (self.tp_size if self.sequence_parallel else 1)
        if cp is None:
            rows = torch.arange(n, device=x.device)  # index in the sequence
        else:  # each sample's own when its documents are balanced over the ranks: [s, b]
            rows = cp.shard.positions if cp.sample_positions is None else cp.sample_positions.t()
        if self.sequence_parallel:
            rows = rows[self.tp_rank * x.size(0):(self.tp_rank + 1) * x.size(0)]
        return DropoutKey(samples=keys, rows=rows)

    def _stage_forward(self, position_ids, attention_mask, labels, cp=None, dropout_keys=None,
                       mtp=(None, None)) -> torch.Tensor:
        """A later pipeline stage: start from the hidden states handed over by ``set_input_tensor``."""
        x, self._input_tensor = self._input_tensor, None
        if x is None:
            raise RuntimeError("this pipeline stage has no embedding (pre_process=False): call set_input_tensor() "
                               "with the previous stage's output before forward")
        s = x.size(0) * (self.tp_size if self.sequence_parallel else 1)
        if position_ids is None:
            position_ids = torch.arange(s, device=x.device)
        rotary = self.rotary(position_ids) if self.rotary is not None else None
        context = ForwardContext(rotary, attention_mask, cp, self._dropout_key(x, dropout_keys, cp),
                                 self._document_starts(attention_mask, cp, x.size(1), s))
        x = self._run_layers(x, context)
        return self._head(x, labels, context, mtp) if self.post_process else x

    def _head(self, x: torch.Tensor, labels: Optional[torch.Tensor], context: ForwardContext,
              mtp: tuple) -> torch.Tensor:
        """The last stage's end: multi-token prediction (training, with labels), final norm, logits and loss.
        ``context``: what the layers were given."""
        x = self.final_norm(x)
        if self.mtp is not None and labels is not None and self.training:
            targets, mask = mtp
            if targets is None:
                targets, mask = multi_token_targets(labels, torch.ones_like(labels, dtype=torch.float32),
                                                    self.config.mtp_num_layers)
            x = self.mtp(x, labels, targets, mask, self._embed, self._token_loss, context)
        if labels is None:
            return self._logits(x).transpose(0, 1).contiguous()
        return self._token_loss(x, labels)

    def _token_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Normed hidden states ``[s(/tp), b, h]`` and ``labels`` ``[b, s]`` -> per-token fp32 loss ``[b, s]``."""
        logits = self._logits(x)  # [s, b, padded_vocab/tp]
        # inplace: the logits are this head's temporary; fp32 ones become the softmax backward keeps
        loss = mpu.vocab_parallel_cross_entropy(logits, labels.t(), self.config.label_smoothing, group=self.tp_group,
                                                vocab_size=self.config.vocab_size, inplace=True)  # [s, b] fp32
        return loss.t().contiguous()

    def _embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids ``[b, s]`` -> embeddings ``[s(/tp), b, h]`` as the layers take them (multi-token prediction)."""
        x = self.embedding(ids).transpose(0, 1).contiguous()
        if self.config.fp32_residual_connection:
            x = x.float()
        if self.sequence_parallel:
            x = mpu.scatter_to_sequence_parallel_region(x, self.tp_group)
        return x

    def _run_layers(self, x: torch.Tensor, context: ForwardContext) -> torch.Tensor:
        c = self.config

        def run(layers, h):
            for layer in layers:
                h = layer(h, context)
            return h

        if not (c.recompute_granularity == "full" and self.training and torch.is_grad_enabled()):
            return run(self.layers, x)
        k = c.recompute_num_layers
        if c.recompute_method == "uniform":  # checkpoint chunks of k consecutive layers
            for start in range(0, len(self.layers), k):
                chunk = self.layers[start:start + k]
                x = mpu.checkpoint(lambda h, chunk=chunk: run(chunk, h), x)
            return x
        for i, layer in enumerate(self.layers):  # 'block': checkpoint only the first k layers
            x = mpu.checkpoint(lambda h, layer=layer: run([layer], h), x) if i < k else run([layer], x)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[s(/tp), b, h]`` -> ``[s, b, padded_vocab/tp]`` (Megatron's parallel_lm_logits)."""
        logits, _ = self.output_layer(x, weight=self.embedding.weight if self.config.tie_embeddings else None)
        if self._first_padded_col < logits.size(-1):
            padded = torch.arange(logits.size(-1), device=logits.device) >= self._first_padded_col
            logits = logits.masked_fill(padded, float("-inf"))
        return logits



def _check_context_parallel(position_ids: Optional[torch.Tensor]) -> None:
    """Refuse what a context-parallel forward cannot do, saying how to run instead. Dropout of any kind
    runs: keyed by position with ``dropout_rng='position'`` (the same masks as cp 1), else drawn per rank."""
    if position_ids is None:
        raise ValueError("a context-parallel forward needs position_ids: the global positions of this rank's tokens "
                         "(the layout's positions), or positions, rotary angles and masks would be the chunk's own")
