"""Checkpoint I/O at scale: a rank reads about its own state, verifies what it reads, and a
failure anywhere stops every rank with the failing rank's message."""

import json
import os
import shutil
import time

import pytest
import torch

from megazero import mpu, zero
from megazero.model import GPTModel
from megazero.checkpoint.native import checkpoint_dir, load_checkpoint, save_checkpoint
from megazero.utils.phase_agreement import RunAborted
from megazero.zero.checkpoint import CheckpointReader, read_full_parameters
from tests.distributed import run_distributed
from tests.zero.common import GLOBAL_MICRO_ROWS, batches, ds_config, tiny_config

# Wide enough that the safetensors headers are small next to the tensors; SwiGLU for a
# stride-2 TP partition, untied output layer for a second vocab-parallel weight.
MODEL = dict(hidden_size=64, num_attention_heads=4, activation="swiglu", tie_embeddings=False, vocab_size=500)


def _engine(tp, stage, seed=5):
    mpu.initialize_model_parallel(tp)
    torch.manual_seed(seed)
    micro = GLOBAL_MICRO_ROWS // mpu.get_data_parallel_world_size()
    return zero.initialize(GPTModel(tiny_config(**MODEL), device="meta"), ds_config(stage, micro=micro), mpu=mpu)


def _step(engine):
    dp, r = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    micro = GLOBAL_MICRO_ROWS // dp
    rows = batches(1, 1, GLOBAL_MICRO_ROWS, vocab=500)[0, 0, r * micro:(r + 1) * micro]
    engine.backward(engine(rows[:, :-1], labels=rows[:, 1:]).mean())
    engine.step()


def _save(directory, fail_rank=None):
    engine = _engine(2, 3)
    _step(engine)
    if fail_rank is not None:
        def failing(partial):  # once this rank's files are written, before the commit
            if torch.distributed.get_rank() == fail_rank:
                raise OSError(f"disk quota exceeded (injected on rank {fail_rank})")

        try:
            save_checkpoint(directory, 1, engine, train_state={"iteration": 1}, config={}, on_written=failing)
        except RunAborted as e:
            return str(e)
        return None
    save_checkpoint(directory, 1, engine, train_state={"iteration": 1}, config={})
    return engine.consolidated_state_dict()


def _load(directory, tp, stage):
    engine = _engine(tp, stage, seed=99)
    try:
        state = load_checkpoint(directory, engine)
    except RunAborted as e:
        return {"error": str(e)}
    own = sum(g.shard_numel for g in engine.groups) * 4 * 3  # fp32 master + two Adam moments
    return {"bytes": state["bytes_read"], "own": own, "sd": engine.consolidated_state_dict()}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("io_tp2_dp2_z3"))
    sd = run_distributed(4, _save, d)[0]
    return d, sd


@pytest.mark.parametrize("world,tp,stage,bound", [(4, 2, 3, None), (4, 1, 1, 2.0), (4, 4, 2, 2.0), (1, 1, 0, 2.0)])
def test_each_rank_reads_about_its_own_state(saved, world, tp, stage, bound):
    directory, expected = saved
    out = run_distributed(world, _load, directory, tp, stage)
    for rank, o in enumerate(out):
        ratio = o["bytes"] / o["own"]
        print(f"{world}x tp{tp} ZeRO-{stage} rank {rank}: read {o['bytes']} B, own state {o['own']} B, ratio {ratio:.3f}")
        if bound is None:  # the same layout: the rank's own files, nothing else
            it = os.path.join(directory, "iter_0000001")
            own_files = sum(os.path.getsize(os.path.join(it, f"{kind}_rank{rank:05d}.safetensors")) for kind in ("zero", "rng"))
            metadata = os.path.getsize(os.path.join(it, "manifest.json"))  # read by all: O(files), ~1 MB at 64 ranks
            assert 0.95 * o["own"] <= o["bytes"] <= own_files + metadata, (rank, o["bytes"], o["own"], own_files, metadata)
            assert o["bytes"] - metadata <= 1.05 * o["own"], (rank, o["bytes"], o["own"])
        else:
            assert ratio <= bound, (rank, o["bytes"], o["own"])
    for k, v in expected.items():
        torch.testing.assert_close(out[0]["sd"][k], v, atol=0, rtol=0, msg=lambda m: f"{k}: {m}")


def test_tp_shard_and_full_reads_match(saved):
    directory, expected = saved
    reader = CheckpointReader(directory + "/iter_0000001")
    for name in ("layers.0.mlp.linear_fc1.weight", "layers.1.mlp.linear_fc2.weight", "output_layer.weight"):
        full = reader.full(name)
        torch.testing.assert_close(full, expected[name], atol=0, rtol=0)
        p = dict(GPTModel(tiny_config(**MODEL), device="meta").named_parameters())[name]
        from megazero.mpu.sharding import shard_of_full

        for world in (2, 4):
            for r in range(world):
                want = shard_of_full(full, p.partition_dim, getattr(p, "partition_stride", 1), r, world)
                torch.testing.assert_close(reader.tp_shard(name, r, world), want, atol=0, rtol=0)


def test_corrupt_chunk_on_one_rank_stops_every_rank_with_the_file_named(saved, tmp_path):
    directory, _ = saved
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    shard = bad / "iter_0000001" / "zero_rank00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-100] ^= 0xFF
    shard.write_bytes(bytes(data))
    out = run_distributed(4, _load, str(bad), 2, 3)
    for o in out:  # only rank 2 reads that file; all four stop with its message
        assert "zero_rank00002.safetensors does not match its sha256" in o["error"] and "rank 2" in o["error"], o


def test_corrupt_manifest_stops_every_rank(saved, tmp_path):
    directory, _ = saved
    bad = tmp_path / "bad"
    shutil.copytree(directory, bad)
    (bad / "iter_0000001" / "manifest.json").write_text("{not json")
    out = run_distributed(2, _load, str(bad), 1, 1)
    assert all("manifest.json is not valid JSON" in o["error"] for o in out), out


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_failure_during_save_stops_every_rank(tmp_path, fail_rank):
    t0 = time.time()
    out = run_distributed(4, _save, str(tmp_path), fail_rank, timeout_s=60)
    assert time.time() - t0 < 30
    for o in out:
        assert f"injected on rank {fail_rank}" in o and f"rank {fail_rank}" in o, o
    assert not os.path.exists(tmp_path / "latest")


@pytest.mark.parametrize("fail_rank", [0, 1])
def test_failure_during_load_stops_every_rank(saved, fail_rank):
    directory, _ = saved
    t0 = time.time()
    out = run_distributed(4, _load_failing, directory, fail_rank, timeout_s=60)
    assert time.time() - t0 < 30
    assert all(f"injected on rank {fail_rank}" in o for o in out), out


def _load_failing(directory, fail_rank):
    import megazero.checkpoint.native as ck

    original = ck.read_zero_state

    def failing(engine, d, manifest, **kw):
        if torch.distributed.get_rank() == fail_rank:
            raise RuntimeError(f"bug (injected on rank {fail_rank})")
        return original(engine, d, manifest, **kw)

    ck.read_zero_state = failing
    try:
        return _load(directory, 2, 3)["error"]
    finally:
        ck.read_zero_state = original


def test_manifest_is_durable_and_chunked(saved):
    directory, _ = saved
    manifest = json.load(open(os.path.join(checkpoint_dir(directory, 1), "manifest.json")))
    assert manifest["layout"] == {"tp_size": 2, "dp_size": 2, "stage": 3}
    entry = manifest["files"]["zero_rank00003.safetensors"]
    assert (entry["tp_rank"], entry["dp_rank"]) == (1, 1) and len(entry["chunks"]) > 1
    assert read_full_parameters(checkpoint_dir(directory, 1), manifest=manifest).keys() == set(
        n for n, _ in GPTModel(tiny_config(**MODEL), device="meta").named_parameters())


def _from_full_file(path, tp, stage):
    from megazero.zero.checkpoint import load_full_weights_file

    engine = _engine(tp, stage, seed=77)
    load_full_weights_file(engine, path)
    return engine.consolidated_state_dict()


@pytest.mark.parametrize("tp,stage", [(2, 3), (4, 1), (1, 2)])
def test_pretrained_full_weights_are_read_row_by_row_into_any_layout(tmp_path, tp, stage):
    from safetensors.torch import save_file

    torch.manual_seed(11)
    ref = GPTModel(tiny_config(**MODEL))
    sd = {k: v.detach().to(torch.bfloat16).float().to(torch.bfloat16) for k, v in ref.state_dict().items()}
    path = str(tmp_path / "model_full.safetensors")
    save_file({k: v.contiguous() for k, v in sd.items()}, path)
    out = run_distributed(4, _from_full_file, path, tp, stage)[0]
    for k, v in sd.items():
        torch.testing.assert_close(out[k], v.float(), atol=0, rtol=0, msg=lambda m: f"{k}: {m}")
