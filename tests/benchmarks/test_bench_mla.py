"""benchmarks/bench_mla.py: its FLOP counts are the layer's (counted by torch's FlopCounterMode), the
matched standard attention is within the tolerance, and a tiny run prints its figures (the ring's bytes
equal to the formula)."""

import re
from pathlib import Path

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import bench_mla
from megazero.model.forward_context import ForwardContext
from megazero import mpu
from megazero.model.attention.rope import rotary_embedding
from megazero.model.transformer import TransformerLayer

ROOT = Path(__file__).resolve().parents[2]
TINY = bench_mla.Widths(64, 2, 16, 8, 16, 32, None)


def _counted_forward_flops(config, seq: int) -> int:
    """The forward's matmul FLOPs as torch counts them; the explicit formula's matmuls (the math backend),
    as the counter does not see the CPU's fused SDPA kernel."""
    config = config.replace(attention_backend="math")
    layer = TransformerLayer(config, tp_group=mpu.NO_GROUP, tp_size=1)
    x = torch.randn(seq, 1, config.hidden_size)
    rotary = rotary_embedding(config)(torch.arange(seq).unsqueeze(0))
    with FlopCounterMode(display=False) as counter:
        layer(x, ForwardContext(rotary))
    return counter.get_total_flops()


@pytest.mark.parametrize("q_lora", [None, 24])
def test_closed_form_flops_are_the_layers_matmuls(q_lora):
    seq = 32
    mla = bench_mla.mla_config(bench_mla.Widths(64, 2, 16, 8, 12, 32, q_lora), seq, torch.float32)
    std = bench_mla.standard_config(mla, 4, 16, 2)
    for config in (mla, std):
        assert _counted_forward_flops(config, seq) == bench_mla.layer_flops(config, seq) * seq


def test_matched_standard_attention_is_within_tolerance_and_prefers_multi_head():
    w = bench_mla.Widths(512, 4, 128, 64, 128, 512, None)
    for seq in (1024, 4096):
        mla = bench_mla.mla_config(w, seq, torch.float32)
        std = bench_mla.match_standard(mla, seq)
        assert not std.multi_latent_attention and std.query_groups == std.num_attention_heads
        assert abs(bench_mla.layer_flops(std, seq) / bench_mla.layer_flops(mla, seq) - 1) <= 0.03
    assert bench_mla.kv_cache_values(bench_mla.mla_config(w, 1024, torch.float32)) == 576


def test_tiny_run_prints_its_figures(capsys):
    torch.set_num_threads(1)
    assert bench_mla.main(["--tiny", "--parts", "layer", "core", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    for dtype in ("fp32", "bf16"):
        rows = re.findall(rf"layer {dtype}\s+[AB] .*?\s([\d.]+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)$", out, re.M)
        assert len(rows) == 2, out
        assert all(float(tokens) > 0 and float(peak) > 0 for _, tokens, _, peak in rows)
    assert len(re.findall(r"CPU time x[\d.]+ \(pairs [\d.]+-[\d.]+, n=2\)", out)) == 4, out
    assert len(re.findall(r"[AB] [\d.]+ M \(agrees\)", out)) == 4, out  # the counts are megazero.model.flops's
    assert "B (latent 32 + rope 8) 40 values" in out


def test_tiny_ring_sends_the_formulas_bytes(monkeypatch, capsys):
    # the script's main in this process (its ranks are processes of their own); the ring part imports its
    # sibling modules as the script does, from benchmarks/
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    assert bench_mla.main(["--tiny", "--parts", "ring"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    table = lines[[i for i, line in enumerate(lines) if "fwd KiB sent" in line][0] + 1:]
    rows = {line[2:42].strip(): [float(x) for x in line[42:].split()[:2]] for line in table if line.strip()}
    assert len(rows) == 3 and "MISMATCH" not in out, out
    assert all(fwd == formula > 0 for fwd, formula in rows.values()), out
    sent = {name: fwd for name, (fwd, _) in rows.items()}
    # V padded to q/k's width sends more: (24 + 24) / (24 + 16) of MLA's bytes
    assert sent["MLA, V padded to 24"] == pytest.approx(sent["MLA qk 24 / v 16"] * 48 / 40, rel=1e-3)
