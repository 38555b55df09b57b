"""Which transformer layers each pipeline stage (and each of its virtual chunks) builds.

Even split by default: ``num_layers / (pp * v)`` layers per model chunk. Megatron-core's
``--decoder-first-pipeline-num-layers`` / ``--decoder-last-pipeline-num-layers`` give the
first and/or last stage a set number of layers (often fewer: those stages also hold the
embedding and the output head); the other stages split the rest evenly. With ``v``
virtual stages each stage's layers are split evenly over its ``v`` chunks, and chunk ``c``
of rank ``r`` is virtual stage ``c * pp + r``, so its layers follow those of every
chunk ``< c`` on every rank and of chunk ``c`` on ranks ``< r``.

All functions are pure; errors say which numbers clash and what would work.
"""

from __future__ import annotations

import re
from typing import Callable, Optional, Sequence

import torch

__all__ = ["PipelineSplitError", "stage_num_layers", "chunk_layer_range", "layers_per_chunk_table",
           "build_stage_chunks", "build_pipeline_model", "StageChunks", "global_name_fn",
           "virtual_stages_from_layers_per_stage", "local_to_global_name", "global_to_local_name"]


class PipelineSplitError(ValueError):
    """The layers cannot be split over the requested pipeline."""


def stage_num_layers(num_layers: int, pp: int, first: Optional[int] = None, last: Optional[int] = None) -> list[int]:
    """Layers of each pipeline stage (all chunks together)."""
    if pp < 1 or num_layers < 1:
        raise PipelineSplitError(f"num_layers ({num_layers}) and pipeline size ({pp}) must be >= 1")
    if (first is not None or last is not None) and pp == 1:
        raise PipelineSplitError("decoder_first/last_pipeline_num_layers need a pipeline (pp > 1)")
    if first is None and last is None:
        if num_layers % pp:
            raise PipelineSplitError(
                f"num_layers ({num_layers}) is not divisible by the pipeline size ({pp}); use a pipeline size that "
                f"divides it, or set decoder_first_pipeline_num_layers / decoder_last_pipeline_num_layers for an "
                f"uneven split")
        return [num_layers // pp] * pp
    for name, n in (("decoder_first_pipeline_num_layers", first), ("decoder_last_pipeline_num_layers", last)):
        if n is not None and n < 0:
            raise PipelineSplitError(f"{name} must be >= 0, got {n}")
    middle_stages = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    if middle_layers < 0 or (middle_stages == 0 and middle_layers != 0) or (middle_stages and middle_layers % middle_stages):
        raise PipelineSplitError(
            f"num_layers ({num_layers}) minus decoder_first_pipeline_num_layers ({first}) and "
            f"decoder_last_pipeline_num_layers ({last}) leaves {middle_layers} layers for the {middle_stages} other "
            f"stage(s); that number must split evenly over them")
    per_middle = middle_layers // middle_stages if middle_stages else 0
    counts = [per_middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def layers_per_chunk_table(num_layers: int, pp: int, v: int = 1, first: Optional[int] = None,
                           last: Optional[int] = None, segments: Optional[Sequence[int]] = None) -> list[list[range]]:
    """``table[chunk][rank]`` = global layer indices of that model chunk. ``segments``: the layers of each
    segment a hybrid pattern's ``|`` cuts (``pp x v`` of them, virtual stage i holding segment i; ignored at pp 1)."""
    if v < 1:
        raise PipelineSplitError(f"virtual pipeline size must be >= 1, got {v}")
    if segments is not None and pp > 1:
        return _segment_table(list(segments), num_layers, pp, v, first, last)
    counts = stage_num_layers(num_layers, pp, first, last)
    for r, n in enumerate(counts):
        if n % v:
            raise PipelineSplitError(
                f"stage {r} has {n} layers, not divisible by the {v} virtual pipeline stages; with v = {v} the "
                f"layers of every stage must be a multiple of {v} (num_layers {num_layers}, pp {pp}, "
                f"first {first}, last {last})")
    table, start = [], 0
    for _ in range(v):
        row = []
        for r in range(pp):
            n = counts[r] // v
            row.append(range(start, start + n))
            start += n
        table.append(row)
    return table


def _segment_table(segments: list[int], num_layers: int, pp: int, v: int, first: Optional[int],
                   last: Optional[int]) -> list[list[range]]:
    """The table of a pattern cut by ``|``: virtual stage ``c * pp + r`` holds segment ``c * pp + r``."""
    if first is not None or last is not None:
        raise PipelineSplitError("the hybrid layer pattern's '|' cuts place every stage's layers: drop "
                                 "decoder_first/last_pipeline_num_layers")
    if sum(segments) != num_layers or len(segments) != pp * v:
        raise PipelineSplitError(
            f"the hybrid layer pattern's '|' cuts it into {len(segments)} segments, which must be pipeline size "
            f"({pp}) x virtual stages per rank ({v}) = {pp * v}: one segment per (virtual) stage; cut it into a "
            f"multiple of {pp} segments and set the virtual pipeline size to that multiple")
    bounds = [sum(segments[:i]) for i in range(len(segments) + 1)]
    return [[range(bounds[c * pp + r], bounds[c * pp + r + 1]) for r in range(pp)] for c in range(v)]


def chunk_layer_range(num_layers: int, pp: int, pp_rank: int, v: int = 1, chunk: int = 0,
                      first: Optional[int] = None, last: Optional[int] = None) -> range:
    """Global indices of the layers built by ``chunk`` of pipeline rank ``pp_rank``."""
    if not 0 <= pp_rank < pp or not 0 <= chunk < v:
        raise PipelineSplitError(f"pipeline rank {pp_rank} / chunk {chunk} outside pp {pp} x v {v}")
    return layers_per_chunk_table(num_layers, pp, v, first, last)[chunk][pp_rank]


def virtual_stages_from_layers_per_stage(num_layers: int, pp: int, layers_per_virtual_stage: int) -> int:
    """Megatron's ``--num-layers-per-virtual-pipeline-stage`` -> number of chunks per rank."""
    if layers_per_virtual_stage < 1 or num_layers % (pp * layers_per_virtual_stage):
        raise PipelineSplitError(
            f"num_layers ({num_layers}) must be divisible by pp ({pp}) x num_layers_per_virtual_pipeline_stage "
            f"({layers_per_virtual_stage})")
    return num_layers // (pp * layers_per_virtual_stage)


# A decoder layer's name (``layers.{i}.``, under any wrapper's prefix); multi-token prediction's
# ``mtp.layers.{k}`` are numbered by depth, the same on every stage that holds them.
_LAYER = re.compile(r"^((?:.*\.)?layers\.)(\d+)(\..*)$")
_MTP = re.compile(r"^(?:.*\.)?mtp\.layers\.")


def local_to_global_name(name: str, layers: range) -> str:
    """``layers.{i}.x`` of a chunk holding ``layers`` -> ``layers.{layers[i]}.x``; other names unchanged."""
    m = None if _MTP.match(name) else _LAYER.match(name)
    return name if m is None else f"{m.group(1)}{layers[int(m.group(2))]}{m.group(3)}"


def global_to_local_name(name: str, layers: range) -> Optional[str]:
    """Inverse of :func:`local_to_global_name`; None for a layer this chunk does not hold."""
    m = None if _MTP.match(name) else _LAYER.match(name)
    if m is None:
        return name
    i = int(m.group(2))
    return f"{m.group(1)}{i - layers.start}{m.group(3)}" if i in layers else None


class StageChunks(torch.nn.Module):
    """The ``v`` model chunks of one pipeline rank as one module: ``forward(chunk, *args)``.

    Chunks are plain attributes (not a ModuleList) so ZeRO still finds each chunk's
    transformer layers as its units; parameters are named ``chunk{c}.<chunk's name>``.
    """

    def __init__(self, chunks: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.num_chunks = len(chunks)
        for i, c in enumerate(chunks):
            self.add_module(f"chunk{i}", c)

    def chunk(self, i: int) -> torch.nn.Module:
        return getattr(self, f"chunk{i}")

    def forward(self, chunk: int, *args, **kwargs):
        return self.chunk(chunk)(*args, **kwargs)


def global_name_fn(chunks: Sequence) -> Callable[[str], str]:
    """Name in this rank's module (one chunk, or :class:`StageChunks` of them) -> the pp = 1 name.

    Initialization keys weights by these names and checkpoints list them, so a model is the
    same function of the seed at every pipeline layout (``layers.0`` of the second stage of
    a 4-layer pp = 2 model is ``layers.2``; the last stage's copy of the tied embedding is the
    embedding itself).
    """
    ranges = [c.layer_range for c in chunks]
    if len(ranges) == 1:
        return lambda name: local_to_global_name(name, ranges[0])

    def name_of(name: str) -> str:
        head, rest = name.split(".", 1)
        return local_to_global_name(rest, ranges[int(head[len("chunk"):])])

    return name_of


def build_stage_chunks(config, *, pp: int, pp_rank: int, v: int = 1, first: Optional[int] = None,
                       last: Optional[int] = None, tp_group=None, device=None, groups=None) -> list:
    """The model chunks (``GPTModel`` each) pipeline rank ``pp_rank`` holds, chunk 0 first.

    Chunk ``c`` is virtual stage ``c * pp + pp_rank``: the first virtual stage has the
    embedding, the last the final norm, head and loss (and, with tied embeddings and
    pp > 1, its copy of the word embedding). ``device='meta'`` for ZeRO to materialize. ``groups``: the run's
    :class:`megazero.mpu.ParallelGroups`, handed to every chunk (else ``tp_group`` alone).
    """
    from .gpt import GPTModel  # the split itself stays importable without torch modules

    table = layers_per_chunk_table(config.num_layers, pp, v, first, last, config.pipeline_segments)
    chunks = []
    for c in range(v):
        vs = c * pp + pp_rank
        handed = dict(groups=groups) if groups is not None else dict(tp_group=tp_group)
        chunks.append(GPTModel(config, **handed, device=device, pre_process=vs == 0,
                               post_process=vs == pp * v - 1, layers=table[c][pp_rank]))
    return chunks


def build_pipeline_model(config, groups, *, first: Optional[int] = None, last: Optional[int] = None, device=None):
    """This rank's model for ``groups`` (a :class:`megazero.mpu.ParallelGroups`): ``(module, chunks)``.

    ``module`` is what to hand to ``zero.initialize``: the single chunk when
    ``groups.virtual_pp_size == 1`` (parameter names as without a pipeline, layers
    numbered locally), else a ``StageChunks`` holding every chunk. ``chunks`` go to
    ``megazero.pipeline.PipelineStage``.
    """
    chunks = build_stage_chunks(config, pp=groups.pp_size, pp_rank=groups.pp_rank, v=groups.virtual_pp_size,
                                first=first, last=last, groups=groups, device=device)
    if len(chunks) == 1:
        return chunks[0], chunks
    return StageChunks(chunks), chunks
