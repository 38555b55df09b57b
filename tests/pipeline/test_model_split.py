"""Pipeline split of the GPT: layer ranges, stage contents, and stage-by-stage equality with pp = 1."""

from __future__ import annotations

import pytest
import torch

from megazero.model import GPTModel
from megazero.model.pipeline_split import (PipelineSplitError, build_stage_chunks, chunk_layer_range,
                                           global_to_local_name, layers_per_chunk_table, local_to_global_name,
                                           stage_num_layers, virtual_stages_from_layers_per_stage)
from tests.model.common import batch, tiny_config


def test_even_and_uneven_layer_counts():
    assert stage_num_layers(8, 4) == [2, 2, 2, 2]
    # Megatron-core's flags: the end stages take fewer layers, the middle ones split the rest.
    assert stage_num_layers(10, 4, first=1, last=1) == [1, 4, 4, 1]
    assert stage_num_layers(9, 4, first=3) == [3, 2, 2, 2]
    assert stage_num_layers(7, 4, last=1) == [2, 2, 2, 1]
    assert stage_num_layers(5, 2, first=2, last=3) == [2, 3]


def test_virtual_chunks_follow_megatron_order():
    # pp 2, v 2, 8 layers: chunk 0 = virtual stages 0 (rank 0) and 1 (rank 1), chunk 1 = 2 and 3.
    table = layers_per_chunk_table(8, 2, 2)
    assert [[list(r) for r in row] for row in table] == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert chunk_layer_range(12, 2, 1, v=2, first=4, last=8) == range(2, 6)
    assert virtual_stages_from_layers_per_stage(16, 4, 2) == 2


@pytest.mark.parametrize("kw,match", [
    (dict(num_layers=7, pp=2), r"num_layers \(7\) is not divisible by the pipeline size \(2\)"),
    (dict(num_layers=8, pp=4, v=3), r"stage 0 has 2 layers, not divisible by the 3 virtual"),
    (dict(num_layers=8, pp=3, last=1), r"leaves 7 layers for the 2 other"),
    (dict(num_layers=8, pp=2, first=9), r"leaves -1 layers"),
    (dict(num_layers=8, pp=2, first=3, last=3), r"leaves 2 layers for the 0 other"),
    (dict(num_layers=8, pp=1, first=3), r"need a pipeline"),
])
def test_impossible_splits_name_the_numbers(kw, match):
    with pytest.raises(PipelineSplitError, match=match):
        layers_per_chunk_table(**kw)


def test_names_map_between_chunk_and_full_model():
    assert local_to_global_name("layers.1.mlp.linear_fc1.weight", range(4, 6)) == "layers.5.mlp.linear_fc1.weight"
    assert global_to_local_name("layers.5.mlp.linear_fc1.weight", range(4, 6)) == "layers.1.mlp.linear_fc1.weight"
    assert global_to_local_name("layers.3.mlp.linear_fc1.weight", range(4, 6)) is None
    assert local_to_global_name("embedding.weight", range(4, 6)) == "embedding.weight"


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_each_stage_builds_only_its_parts(arch):
    cfg = tiny_config(arch, num_layers=4)
    stages = [build_stage_chunks(cfg, pp=2, pp_rank=r, device="meta")[0] for r in range(2)]
    names = [set(n for n, _ in s.named_parameters()) for s in stages]
    assert any(n.startswith("embedding.") for n in names[0])
    assert not any(n.startswith(("final_norm.", "output_layer.")) for n in names[0])
    assert not any(n.startswith("position_embeddings.") for n in names[1])
    assert any(n.startswith("final_norm.") for n in names[1])
    assert {n.split(".")[1] for n in names[0] if n.startswith("layers.")} == {"0", "1"}
    tied = cfg.tie_embeddings
    # The last stage holds the word embedding only as the tied head, and marks that copy.
    assert ("embedding.weight" in names[1]) == tied and ("output_layer.weight" in names[1]) == (not tied)
    if tied:
        assert stages[1].embedding.weight.pipeline_shared_copy and stages[1].embedding.weight.shared
        assert not getattr(stages[0].embedding.weight, "pipeline_shared_copy", False)
    # A middle stage of pp 4 has layers only.
    middle = build_stage_chunks(cfg, pp=4, pp_rank=1, device="meta")[0]
    assert {n.split(".")[0] for n, _ in middle.named_parameters()} == {"layers"}


def test_tied_copy_starts_equal_under_one_seed():
    cfg = tiny_config("gpt", num_layers=4)
    torch.manual_seed(3)
    first = build_stage_chunks(cfg, pp=2, pp_rank=0)[0]
    torch.manual_seed(3)
    last = build_stage_chunks(cfg, pp=2, pp_rank=1)[0]
    assert torch.equal(first.embedding.weight, last.embedding.weight)


def _load_from_full(chunk: GPTModel, full: dict) -> None:
    chunk.load_state_dict({n: full[local_to_global_name(n, chunk.layer_range)] for n in chunk.state_dict()})


@pytest.mark.parametrize("arch,pp,v,first,last", [("gpt", 2, 1, None, None), ("llama", 4, 1, None, None),
                                                  ("gpt", 2, 2, None, None), ("llama", 3, 1, 2, 1)])
def test_stages_chained_equal_the_full_model(arch, pp, v, first, last):
    """Running the chunks in virtual-stage order gives pp = 1's loss and gradients."""
    cfg = tiny_config(arch, num_layers=4 if first is None else 5)
    torch.manual_seed(0)
    full = GPTModel(cfg)
    ids, labels = batch(cfg)
    ref = full(ids, labels=labels).mean()
    ref.backward()
    chunks = {(r, c): m for r in range(pp)
              for c, m in enumerate(build_stage_chunks(cfg, pp=pp, pp_rank=r, v=v, first=first, last=last))}
    for m in chunks.values():
        _load_from_full(m, full.state_dict())
    x = None
    for vs in range(pp * v):
        m = chunks[(vs % pp, vs // pp)]
        if vs == 0:
            x = m(ids)
        else:
            m.set_input_tensor(x)
            x = m(None, labels=labels if vs == pp * v - 1 else None)
    assert x.shape == labels.shape
    loss = x.mean()
    torch.testing.assert_close(loss, ref, atol=0, rtol=0)
    loss.backward()
    grads = {}
    for m in chunks.values():
        for n, p in m.named_parameters():
            key = local_to_global_name(n, m.layer_range)
            grads[key] = grads.get(key, 0) + p.grad  # the tied copy's gradient adds to the embedding's
    for n, p in full.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, atol=1e-6, rtol=1e-5, msg=lambda s: f"{n}: {s}")


def test_stage_without_input_tensor_says_what_to_do():
    m = build_stage_chunks(tiny_config("gpt", num_layers=2), pp=2, pp_rank=1)[0]
    with pytest.raises(RuntimeError, match="set_input_tensor"):
        m(None)
    with pytest.raises(ValueError, match="contiguous range"):
        GPTModel(tiny_config("gpt", num_layers=2), layers=range(1, 3), device="meta")


def test_build_pipeline_model_from_groups():
    from megazero.mpu import ParallelGroups
    from megazero.model.pipeline_split import build_pipeline_model
    from megazero.model.pipeline_split import StageChunks

    def groups(pp_rank, v):
        return ParallelGroups(tp_size=1, pp_size=2, dp_size=1, tp_rank=0, pp_rank=pp_rank, dp_rank=0, tp_group=None,
                              pp_group=None, dp_group=None, mp_group=None, tp_ranks=(0,), pp_ranks=(0, 1),
                              dp_ranks=(0,), mp_ranks=(0, 1), virtual_pp_size=v)

    cfg = tiny_config("gpt", num_layers=4)
    module, chunks = build_pipeline_model(cfg, groups(1, 1), device="meta")
    assert module is chunks[0] and chunks[0].layer_range == range(2, 4) and chunks[0].post_process
    module, chunks = build_pipeline_model(cfg, groups(1, 2), device="meta")
    assert isinstance(module, StageChunks) and [c.layer_range for c in chunks] == [range(1, 2), range(3, 4)]
    assert not chunks[0].post_process and chunks[1].post_process
