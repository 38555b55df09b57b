"""Tools at scale: generate.py reads only its TP shard; HF conversions stream layer by layer."""

import os
import subprocess
import sys

import pytest
import torch

from megazero import mpu, zero
from megazero.model import GPTConfig, GPTModel
from megazero.checkpoint.reader import open_checkpoint
from megazero.checkpoint.native import save_checkpoint
from tests.distributed import run_distributed
from tests.zero.common import ds_config, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODEL = dict(hidden_size=64, num_attention_heads=4, activation="swiglu", normalization="rmsnorm",
             position_embedding_type="rope", add_bias_linear=False, tie_embeddings=False, vocab_size=500)


def _save(directory, config_dict, tp, stage, step):
    mpu.initialize_model_parallel(tp)
    config = GPTConfig.from_dict(config_dict)
    torch.manual_seed(3)
    engine = zero.initialize(GPTModel(config, device="meta"), ds_config(stage, micro=1), mpu=mpu)
    if step:
        ids = torch.randint(0, config.vocab_size, (1, 17), generator=torch.Generator().manual_seed(mpu.get_data_parallel_rank()))
        engine.backward(engine(ids[:, :-1], labels=ids[:, 1:]).mean())
        engine.step()
    save_checkpoint(directory, 1, engine, train_state={"iteration": 1}, config={"model": config.to_dict()})


def _generate_losses(directory, tp):
    groups = mpu.initialize_model_parallel(tp)
    config, reader, _ = open_checkpoint(directory)
    from megazero.cli.generate import load_tp_shard

    model = load_tp_shard(config, reader, groups)
    ids = torch.randint(0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        loss = model(ids[:, :-1], labels=ids[:, 1:])
    shard_bytes = sum(p.numel() * 4 for p in model.parameters())
    return loss, reader.counter.bytes, shard_bytes


def test_generate_loads_only_its_tp_shard_from_any_layout(tmp_path):
    config = tiny_config(**MODEL)
    run_distributed(4, _save, str(tmp_path), config.to_dict(), 2, 3, True)
    ref, _, _ = run_distributed(1, _generate_losses, str(tmp_path), 1)[0]
    for tp in (2, 4):
        out = run_distributed(tp, _generate_losses, str(tmp_path), tp)
        for loss, read, shard in out:
            torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
            # Masters only (not the Adam moments, which would triple it), this rank's TP shard only; on
            # a model this small the headers and 4 KiB verification chunks are a good part of it.
            print(f"generate tp={tp}: read {read} B for a {shard} B TP shard")
            assert read < 2 * shard, (read, shard)


BIG = dict(num_layers=8, hidden_size=512, num_attention_heads=8, vocab_size=8000, seq_length=64,
           max_position_embeddings=64, make_vocab_size_divisible_by=64)  # ~29M parameters, 116 MB in fp32


def _peak_rss_delta(tool, argv):
    """Peak RSS growth (bytes) of ``tool.main(argv)`` over the process after its imports."""
    code = (
        "import importlib.util, resource, sys\n"
        f"spec = importlib.util.spec_from_file_location('t', {os.path.join(ROOT, 'tools', tool + '.py')!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "import torch, transformers; transformers.GPT2Config(); torch.zeros(1).numpy()\n"
        # One-time costs that do not grow with the model: torch's Python meta kernels and the like.
        "x = torch.empty(4, 6, device='meta'); torch.cat(list(x.reshape(2, 2, 6).unbind(1))).t().contiguous()\n"
        "x.chunk(2)[0].new_zeros(2, 6); torch.cat([x, x.new_zeros(1, 6)])[:3].contiguous()\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        f"rc = m.main({argv!r})\n"
        "print('RSS', base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          # A fixed mmap threshold: glibc's adaptive one (up to 32 MB) would serve the freed
                          # layers' buffers from the heap, whose fragmentation shows as RSS that varies run to run.
                          env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536"))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RSS")]
    assert line, proc.stdout + proc.stderr
    _, base, peak, rc = line[0].split()
    assert rc == "0", proc.stderr
    return (int(peak) - int(base)) * 1024


def test_hf_conversions_stream_layer_by_layer(tmp_path):
    pytest.importorskip("transformers")
    from safetensors import safe_open

    config = tiny_config(**BIG)
    run_distributed(1, _save, str(tmp_path / "ckpt"), config.to_dict(), 1, 0, False)
    model_bytes = sum(p.numel() for p in GPTModel(config, device="meta").parameters()) * 4
    layer_bytes = 12 * 512 * 512 * 4
    assert model_bytes > 100e6
    to_hf = _peak_rss_delta("convert_to_hf", ["--input", str(tmp_path / "ckpt"), "--output", str(tmp_path / "hf")])
    from_hf = _peak_rss_delta("convert_from_hf", ["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz"),
                                                  "--override", "seq_length=64", "--override",
                                                  "make_vocab_size_divisible_by=64"])
    print(f"model {model_bytes / 1e6:.0f} MB, largest layer {layer_bytes / 1e6:.1f} MB; peak RSS growth: "
          f"convert_to_hf {to_hf / 1e6:.1f} MB, convert_from_hf {from_hf / 1e6:.1f} MB")
    # Holding the model (let alone input + output) would need > model_bytes; streaming holds about
    # one layer's input and output.
    assert to_hf < 4 * layer_bytes and from_hf < 4 * layer_bytes
    # The round trip gives the checkpoint's weights back.
    _, reader, _ = open_checkpoint(str(tmp_path / "ckpt"))
    with safe_open(str(tmp_path / "mz" / "model_full.safetensors"), framework="pt") as f:
        for name in ("embedding.weight", "layers.3.self_attention.linear_qkv.weight", "layers.7.mlp.linear_fc2.bias"):
            torch.testing.assert_close(f.get_tensor(name), reader.full(name), atol=0, rtol=0)
