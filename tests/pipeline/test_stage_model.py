"""The model's chunks as the pipeline reads them (megazero.pipeline.StageModel): the activation crossing a
stage boundary, the weight shared by the first and last stage, and a micro-batch's forward arguments."""

from __future__ import annotations

import inspect
import types

import torch

from megazero.model import ModelBatch
from megazero.model.pipeline_split import build_stage_chunks
from megazero.pipeline import StageModel
from tests.model.common import tiny_config


def _groups(tp: int = 1, cp: int = 1):
    return types.SimpleNamespace(tp_size=tp, cp_size=cp)


def test_gpt_chunks_are_stage_models():
    # every method of the protocol, with its parameters' names (the pipeline passes some by keyword)
    methods = [n for n, f in vars(StageModel).items() if callable(f) and not n.startswith("_")]
    assert sorted(methods) == ["set_input_tensor", "shared_embedding", "stage_activation", "stage_inputs"]
    for chunk in build_stage_chunks(tiny_config(num_layers=4), pp=2, pp_rank=0, v=2, device="meta"):
        for name in methods:
            want = list(inspect.signature(getattr(StageModel, name)).parameters)[1:]
            assert list(inspect.signature(getattr(chunk, name)).parameters) == want, name


def test_the_activation_is_the_residual_stream_of_this_ranks_tokens():
    chunk = build_stage_chunks(tiny_config(sequence_parallel=True), pp=2, pp_rank=1, device="meta")[0]
    assert chunk.stage_activation(2, 16, _groups()) == ((16, 2, 64), torch.float32)
    assert chunk.stage_activation(2, 16, _groups(tp=2)) == ((8, 2, 64), torch.float32)  # sequence parallel
    assert chunk.stage_activation(2, 16, _groups(tp=2, cp=2), torch.bfloat16) == ((4, 2, 64), torch.bfloat16)
    plain = build_stage_chunks(tiny_config(), pp=2, pp_rank=1, device="meta")[0]
    assert plain.stage_activation(3, 16, _groups(tp=2, cp=2), torch.float16) == ((8, 3, 64), torch.float16)
    fp32 = build_stage_chunks(tiny_config(fp32_residual_connection=True), pp=2, pp_rank=0, device="meta")[0]
    assert fp32.stage_activation(2, 16, _groups(), torch.bfloat16)[1] == torch.float32


def test_the_tied_embedding_is_shared_by_the_ends_only():
    tied = [build_stage_chunks(tiny_config(num_layers=3), pp=3, pp_rank=r, device="meta")[0] for r in range(3)]
    assert tied[0].shared_embedding() is tied[0].embedding.weight
    assert tied[1].shared_embedding() is None
    assert tied[2].shared_embedding() is tied[2].embedding.weight
    untied = build_stage_chunks(tiny_config("llama"), pp=2, pp_rank=1, device="meta")[0]
    assert untied.shared_embedding() is None
    mtp = build_stage_chunks(tiny_config("llama", mtp_num_layers=1), pp=2, pp_rank=1, device="meta")[0]
    assert mtp.shared_embedding() is mtp.embedding.weight  # multi-token prediction's inputs


def test_a_micro_batch_becomes_the_forward_arguments():
    chunk = build_stage_chunks(tiny_config(), pp=1, pp_rank=0, device="meta")[0]
    ids, labels = torch.zeros(2, 16, dtype=torch.long), torch.ones(2, 16, dtype=torch.long)
    args, kwargs = chunk.stage_inputs((ids, labels), first=True, last=False)
    assert args == (ids,) and kwargs == dict(position_ids=None, attention_mask=None, labels=None)
    keys = torch.arange(2)
    mb = ModelBatch(tokens=ids, labels=labels, loss_mask=torch.ones(2, 16), position_ids=None, attention_mask=None,
                    dropout_keys=keys)
    args, kwargs = chunk.stage_inputs(mb, first=False, last=True)
    assert args == (None,) and set(kwargs) == {"position_ids", "attention_mask", "labels", "dropout_keys"}
    assert kwargs["labels"] is labels and kwargs["dropout_keys"] is keys
