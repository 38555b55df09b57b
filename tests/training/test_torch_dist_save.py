"""``pretrain_gpt.py --ckpt-format torch_dist``: megazero saves Megatron-LM's torch_dist checkpoint.

* The chunk geometry: a rank's flat ZeRO partition of a TP shard becomes rectangles of the global tensor that
  tile it exactly, for every partition dim and stride (SwiGLU's [gate; up]).
* Through ``pretrain_gpt.py`` at one process, tp 2 x pp 2, tp 2 x dp 2 with ZeRO-3 and cp 2 x an uneven pp 2: megatron-core itself
  (``dist_checkpointing.load`` into its ``GPTModel``, strictly) loads the checkpoint at tp 1 and at tp 2 x pp 2
  and computes the logits megazero computes from its own checkpoint of the same run; each rank wrote only its
  share (no element twice). A DeepSeek-V3-shaped model (MLA, MoE with shared experts and expert bias) saved at
  pp 2 x ep 2 loads in megatron-core alike (at one process and at tp 2 x ep 2), its experts as SequentialMLP
  and as GroupedMLP.
* megazero resumes its torch_dist save at another layout as the uninterrupted run, optimizer included.
"""

from __future__ import annotations

import math
import os
import pickle

import pytest
import torch

from megazero.model.interop.megatron_dist import McoreEntry
from megazero.checkpoint.torch_dist_save import flat_boxes, slot_chunks
from tests.mcore import requires_mcore
from tests.training.test_layout_invariance import RTOL, flags, launch, write_corpus
from tests.training.test_megatron_resume import MODEL

# ---- geometry ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(7,), (5, 6), (3, 4, 5)])
def test_flat_boxes_tile_any_range_in_order(shape):
    n = math.prod(shape)
    flat = torch.arange(n)
    full = flat.view(shape)
    for lo in range(0, n, 3):
        for hi in range(lo, n + 1, 5):
            got = []
            for start, offsets, sizes in flat_boxes(shape, lo, hi):
                box = full[tuple(slice(o, o + z) for o, z in zip(offsets, sizes))]
                assert torch.equal(box.reshape(-1), flat[lo + start:lo + start + box.numel()])  # contiguous
                got.append(box.reshape(-1))
            assert torch.equal(torch.cat(got) if got else flat[:0], flat[lo:hi])
            assert len(got) <= 2 * len(shape) - 1


@pytest.mark.parametrize("dim,stride,world,parts", [(0, 1, 2, 3), (0, 2, 2, 3), (1, 1, 4, 2), (0, 2, 4, 5),
                                                    (0, 1, 1, 4)])
def test_partitions_of_tp_shards_rebuild_the_global_tensor(dim, stride, world, parts):
    """Every (TP rank, ZeRO partition) writes its chunks into the stacked global [L, 16, 8] at layer 1."""
    from megazero.mpu.sharding import shard_of_full

    full = torch.randn(16, 8)
    entry = McoreEntry("layers.1.w", "decoder.layers.w", (3, 16, 8), (1,))
    out = torch.zeros(entry.shape)
    written = torch.zeros(entry.shape, dtype=torch.long)
    for rank in range(world):
        shard = shard_of_full(full, dim, stride, rank, world)
        flat, n = shard.reshape(-1), shard.numel()
        bounds = [n * p // parts for p in range(parts + 1)]
        for lo, hi in zip(bounds, bounds[1:]):
            segment = flat[lo:hi]
            for c in slot_chunks(entry, tuple(shard.shape), lo, hi, (dim, stride, rank, world)):
                region = tuple(slice(o, o + z) for o, z in zip(c.offsets, c.sizes))
                out[region] = c.of(segment)
                written[region] += 1
    assert torch.equal(out[1], full) and written[1].eq(1).all() and written[0].eq(0).all()


# ---- through pretrain_gpt.py ---------------------------------------------------------------------------------

TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def _native_logits(load: str, iteration: int) -> tuple:
    """megazero's logits of ``TOKENS`` from its own checkpoint (full weights, one process)."""
    from megazero.model import GPTModel
    from megazero.mpu.utils import NO_GROUP
    from megazero.checkpoint.native import load_full_model

    config, state, _ = load_full_model(load, iteration)
    model = GPTModel(config, tp_group=NO_GROUP, ep_group=NO_GROUP)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all(".expert_bias" in k for k in missing), (missing, unexpected)
    model.eval()
    with torch.no_grad():
        return config, model(TOKENS)[..., :config.vocab_size]  # megazero masks the padded rows


def _distcp_bytes(directory: str) -> tuple[int, int]:
    """(bytes of the ranks' .distcp files, bytes .metadata points at in them)."""
    meta = pickle.load(open(os.path.join(directory, ".metadata"), "rb"))
    files = [f for f in os.listdir(directory) if f.endswith("_0.distcp")]
    on_disk = sum(os.path.getsize(os.path.join(directory, f)) for f in files)
    pointed = sum(s.length for s in meta.storage_data.values() if s.relative_path in files)
    return on_disk, pointed


LAYOUTS = {"one": (1, []), "tp2_pp2": (4, ["--tp", "2", "--pp", "2"]),
           "tp2_dp2_zero3": (4, ["--tp", "2", "--zero-stage", "3"]),
           # context parallelism (ZeRO partitions over dp x cp) and an uneven pipeline (1 + 3 layers)
           "cp2_pp2_uneven": (4, ["--cp", "2", "--pp", "2", "--decoder-first-pipeline-num-layers", "1",
                                  "--zero-stage", "2"])}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """One process saving megazero's checkpoint every 2 iterations of 4 (the reference), and the same run to
    iteration 2 saved as torch_dist at each layout."""
    runs = tmp_path_factory.mktemp("torch_dist_save")
    prefix = write_corpus(runs)
    ref = launch(1, flags(prefix, *MODEL, iters=4) + ["--save", str(runs / "native"), "--save-interval", "2"],
                 runs, "ref")
    for name, (world, extra) in LAYOUTS.items():
        launch(world, flags(prefix, *MODEL, *extra, iters=4) + ["--exit-interval", "2", "--save", str(runs / name),
                                                                "--ckpt-format", "torch_dist"], runs, name)
    return runs, prefix, ref


@pytest.fixture(scope="module")
def mcore_read(saved):
    """megatron-core's logits of every layout's save, read at tp 1 and at tp 2 x pp 2 (one launch each)."""
    from tests.mcore import mcore_logits

    runs, _, _ = saved
    config, _ = _native_logits(str(runs / "native"), 2)
    paths = [str(runs / layout) for layout in LAYOUTS]
    return {(tp, pp): dict(zip(LAYOUTS, mcore_logits(paths, config, TOKENS, tp=tp, pp=pp)))
            for tp, pp in ((1, 1), (2, 2))}


@requires_mcore
@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_megatron_core_loads_the_save_at_any_layout(saved, mcore_read, layout):
    runs, _, _ = saved
    config, expect = _native_logits(str(runs / "native"), 2)
    directory = runs / layout / "iter_0000002"
    assert (runs / layout / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert sorted(p for p in os.listdir(directory) if not p.startswith("__")) == [
        ".metadata", "common.pt", "metadata.json", "tokenizer"]
    for (tp, pp), logits in mcore_read.items():
        got = logits[layout]
        torch.testing.assert_close(got[..., :config.vocab_size], expect, rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"{layout} read by megatron-core at tp {tp} x pp {pp}: {m}")
    on_disk, pointed = _distcp_bytes(str(directory))
    assert on_disk == pointed  # every byte a rank wrote is a chunk of the checkpoint: no element twice


@pytest.mark.slow
def test_common_state_is_megatron_lms(saved):
    from megazero.checkpoint.megatron_pickle import load_megatron_file
    from megazero.checkpoint.torch_dist_source import open_torch_dist

    runs, _, _ = saved
    common = load_megatron_file(str(runs / "tp2_pp2" / "iter_0000002" / "common.pt"))
    args = common["args"]
    assert (common["iteration"], common["checkpoint_version"], args.consumed_train_samples) == (2, 3.0, 16)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.swiglu) == (2, 2, True)
    assert common["optimizer"]["param_state_sharding_type"] == "fully_reshardable"
    assert common["opt_param_scheduler"]["num_steps"] == 16
    config, source, info = open_torch_dist(str(runs / "tp2_pp2"))
    native, _ = _native_logits(str(runs / "native"), 2)
    mine, theirs = config.to_dict(), native.to_dict()
    assert mine.pop("vocab_padding_tp") == 2 and theirs.pop("vocab_padding_tp") == 1  # where each was padded
    assert mine == theirs
    assert info["optimizer"] == "fully_reshardable" and (info["tp"], info["pp"]) == (2, 2)


@pytest.mark.slow
@pytest.mark.parametrize("source,world,extra", [("tp2_pp2", 1, []), ("one", 2, ["--pp", "2"]),
                                                ("tp2_dp2_zero3", 2, ["--tp", "2", "--zero-stage", "2"]),
                                                ("cp2_pp2_uneven", 2, ["--cp", "2"])])
def test_resumes_at_another_layout_as_the_uninterrupted_run(saved, source, world, extra):
    runs, prefix, ref = saved
    name = f"resume_{source}_{world}"
    got = launch(world, flags(prefix, *MODEL, *extra, iters=4) + ["--load", str(runs / source)], runs, name)
    assert sorted(got) == [3, 4], (name, sorted(got))
    for it in (3, 4):
        for key in ("lm_loss", "grad_norm"):
            a, b = got[it][key], ref[it][key]
            assert abs(a - b) <= RTOL * abs(b), f"{name}: iteration {it} {key} {a} vs the uninterrupted run's {b}"
    assert "weights and optimizer" in open(runs / f"{name}.log").read()


DEEPSEEK = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16",
            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
            "--moe-shared-expert-intermediate-size", "16", "--moe-layer-freq", "[0,1,1,1]",
            "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "8", "--qk-head-dim", "8",
            "--qk-pos-emb-head-dim", "4", "--v-head-dim", "8", "--qk-layernorm", "--transformer-impl", "local"]


@requires_mcore
@pytest.mark.slow
def test_deepseek_shape_saved_at_pp2_ep2_loads_in_megatron_core(tmp_path):
    from megazero.checkpoint.torch_dist_source import open_torch_dist
    from tests.mcore import mcore_logits

    prefix = write_corpus(tmp_path)
    save = tmp_path / "ds"
    launch(4, flags(prefix, *MODEL, *DEEPSEEK, "--pp", "2", "--expert-model-parallel-size", "2", iters=2)
           + ["--save", str(save), "--ckpt-format", "torch_dist"], tmp_path, "ds")
    config, source, _ = open_torch_dist(str(save))
    assert any(".mlp.router.expert_bias" in n for n in source.keys())
    one = mcore_logits(str(save), config, TOKENS)
    # read at tp 2 x ep 2 (4 ranks; the save's pp 2 is read at pp 1 above and tp 2 x pp 2 in the dense test)
    torch.testing.assert_close(mcore_logits(str(save), config, TOKENS, tp=2, ep=2), one, rtol=1e-5, atol=1e-5)
    grouped = mcore_logits(str(save), config, TOKENS, ep=2, grouped_gemm=True)  # GroupedMLP reads the same keys
    torch.testing.assert_close(grouped, one, rtol=1e-5, atol=1e-5)
    from megazero.model import GPTModel
    from megazero.mpu.utils import NO_GROUP

    model = GPTModel(config, tp_group=NO_GROUP, ep_group=NO_GROUP)
    model.load_state_dict({n: source.get_tensor(n) for n in source.keys()}, strict=True)
    model.eval()
    with torch.no_grad():
        v = config.vocab_size
        torch.testing.assert_close(model(TOKENS)[..., :v], one[..., :v], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_multi_token_prediction_saved_at_pp2_resumes_as_the_uninterrupted_run(tmp_path):
    """MTP's depth (megatron-core's ``mtp.layers.0.*`` keys, written by the last stage) survives the format."""
    from megazero.checkpoint.torch_dist import TorchDistCheckpoint

    prefix = write_corpus(tmp_path)
    mtp = [*MODEL, "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3"]
    ref = launch(1, flags(prefix, *mtp, iters=4), tmp_path, "ref")
    save = tmp_path / "mtp"
    launch(2, flags(prefix, *mtp, "--pp", "2", iters=4) + ["--exit-interval", "2", "--save", str(save),
                                                          "--ckpt-format", "torch_dist"], tmp_path, "save")
    ckpt = TorchDistCheckpoint(str(save))
    assert "mtp.layers.0.eh_proj.weight" in ckpt.keys()
    assert "optimizer.state.exp_avg.mtp.layers.0.transformer_layer.mlp.linear_fc1.weight" in ckpt.keys()
    assert "mtp.layers.0.eh_proj._extra_state/shard_0_1" in ckpt.metadata.state_dict_metadata
    got = launch(1, flags(prefix, *mtp, iters=4) + ["--load", str(save)], tmp_path, "resumed")
    assert sorted(got) == [3, 4]
    for it in (3, 4):
        for key in ("lm_loss", "mtp_1_loss", "grad_norm"):
            a, b = got[it][key], ref[it][key]
            assert abs(a - b) <= RTOL * abs(b), f"iteration {it} {key} {a} vs the uninterrupted run's {b}"
