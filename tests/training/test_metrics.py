"""Log line, throughput, interval averaging, JSONL/TensorBoard writer and the plot tool."""

import importlib.util
import json
import logging
import math
import sys
from pathlib import Path

import pytest

from megazero.model.flops import flops_per_iteration
from megazero.config import parse_args
from megazero.training import IntervalMeter, IterationStats, MetricsWriter, Throughput, format_log_line, memory_mb
from megazero.training.meters import format_log_lines, peak_tflops

ROOT = Path(__file__).resolve().parents[2]


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_log_line_is_short_and_keeps_megatrons_grep_keys():
    stats = IterationStats(iteration=10, train_iters=100, consumed_samples=640, seconds_per_iteration=0.1234, lr=1e-4,
                           global_batch_size=64, losses={"lm loss": 5.1234}, loss_scale=1.0, grad_norm=1.234,
                           tokens_per_second=1062188.0, tflops_per_rank=412.54, mfu=0.41712, memory_mb=30840.0,
                           memory_capacity_mb=143771.0, peak_memory_source="cuda_peak_allocated", loss_scaling=False)
    line = format_log_line(stats)
    assert line == (" iteration       10/     100 | lm loss: 5.1234 | lr: 1.000E-04 | grad norm: 1.234 | elapsed time per "
                    "iteration (ms): 123.4 | tokens/s: 1062188 | TFLOP/s per rank: 412.5 | MFU: 41.7% | "
                    "peak memory: 30.12 GiB (21%)")
    assert len(line) <= 215  # the Megatron-style line of these numbers had 377 characters
    bare = IterationStats(iteration=1, train_iters=2, consumed_samples=8, seconds_per_iteration=1.0, lr=0.0,
                          global_batch_size=8)
    assert "\n" not in format_log_line(bare) and "TFLOP/s" not in format_log_line(bare)


def test_the_second_line_carries_the_rest_only_when_present():
    stats = IterationStats(iteration=3, train_iters=3, consumed_samples=8, seconds_per_iteration=0.5, lr=1e-4,
                           global_batch_size=4, loss_scale=1073741824.0, skipped_iterations=3, show_batch=True,
                           losses={"moe aux loss": 0.012, "expert load max over mean": 1.8571},
                           timers_ms={"fwd": 1.0, "bwd": 2.0, "step": 0.5})
    first, second = format_log_lines(stats)
    assert "lm loss" not in first  # every iteration of the interval was skipped
    assert second == (" " * len(" iteration        3/       3") + " | consumed samples: 8 | global batch size: 4 | loss scale: 1073741824.0 | "
                      "number of skipped iterations:   3 | moe aux loss: 1.2000E-02 | expert load max over mean: "
                      "1.86 | time (ms) fwd: 1.0 bwd: 2.0 step: 0.5 |")
    assert second.index("|") == first.index("|")  # under the first line's fields


def test_mfu_counts_model_flops_over_the_known_or_given_peak():
    assert (peak_tflops("NVIDIA H100 80GB HBM3"), peak_tflops("NVIDIA H100 PCIe"), peak_tflops("NVIDIA H200"),
            peak_tflops("NVIDIA A100-SXM4-80GB"), peak_tflops("NVIDIA B200"), peak_tflops("Tesla T4")) == \
        (989.0, 756.0, 989.0, 312.0, 2250.0, None)
    base = "--model-preset gpt-tiny --micro-batch-size 2 --train-iters 1 --lr 1 --mock-data --recompute-granularity full"
    cfg = parse_args(base.split(), 4)
    assert Throughput.from_config(cfg).mfu(0.5) is None  # a CPU: no peak known
    t = Throughput.from_config(parse_args((base + " --device-peak-tflops 2").split(), 4))
    model = flops_per_iteration(cfg.model, 8, 64)  # without recompute, unlike TFLOP/s per rank
    assert t.mfu(0.5) == pytest.approx(model / (0.5 * 4) / 2e12)
    assert t.tflops_per_rank(0.5) / 2 > t.mfu(0.5)


def test_throughput():
    t = Throughput(flops_per_iteration=1e15, tokens_per_iteration=64 * 2048, world_size=8)
    assert t.tokens_per_second(0.5) == 262144.0
    assert t.tflops_per_rank(0.5) == pytest.approx(250.0)  # 1e15 / (0.5 s x 8 ranks) / 1e12
    cfg = parse_args("--model-preset gpt-tiny --micro-batch-size 2 --train-iters 1 --lr 1 --mock-data "
                     "--recompute-granularity full".split(), 4)
    t = Throughput.from_config(cfg)
    assert t.flops_per_iteration == flops_per_iteration(cfg.model, 8, 64, recompute_full=True)
    assert (t.tokens_per_iteration, t.world_size) == (8 * 64, 4)


def test_interval_meter_skips_and_nans():
    m = IntervalMeter()
    m.update({"lm loss": 2.0})
    m.update({"lm loss": 4.0})
    m.update({"lm loss": 100.0}, skipped=True)
    m.update({"lm loss": float("nan")})
    s = m.pop(now=m._start + 8.0)
    assert s.losses == {"lm loss": 3.0} and (s.iterations, s.skipped_iterations, s.nan_iterations) == (4, 1, 1)
    assert s.seconds_per_iteration == pytest.approx(2.0)
    assert m.pop().iterations == 0  # the next interval starts empty
    stats = IterationStats.from_summary(s, iteration=4, train_iters=10, consumed_samples=32, lr=0.1,
                                        global_batch_size=8, throughput=Throughput(8e12, 100, 2))
    assert stats.tokens_per_second == pytest.approx(50.0) and stats.tflops_per_rank == pytest.approx(2.0)
    rec = stats.to_record()
    assert rec["lm_loss"] == 3.0 and rec["elapsed_ms_per_iteration"] == pytest.approx(2000.0) and rec["skipped_iterations"] == 1


def test_memory_mb_is_positive_on_cpu():
    assert memory_mb() > 1.0


def test_jsonl_writer_rank0_only(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    with MetricsWriter(str(path), None, rank=0) as w:
        w.write(10, {"lm_loss": 5.0, "lr": 1e-4, "grad_norm": float("inf")})
        w.write(20, {"eval_lm_loss": 4.5})
    MetricsWriter(str(tmp_path / "other.jsonl"), None, rank=1).write(10, {"lm_loss": 1.0})
    assert not (tmp_path / "other.jsonl").exists()
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["iteration"] for r in recs] == [10, 20]
    assert recs[0]["lm_loss"] == 5.0 and recs[0]["grad_norm"] is None and "timestamp" in recs[0]
    with MetricsWriter(str(path), None) as w:  # a resumed run appends
        w.write(30, {"lm_loss": 4.0})
    assert len(path.read_text().splitlines()) == 3


def test_tensorboard_missing_warns_and_continues(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import now raises ImportError
    with caplog.at_level(logging.WARNING):
        w = MetricsWriter(str(tmp_path / "m.jsonl"), str(tmp_path / "tb"), rank=0)
    assert not w.tensorboard_enabled
    assert len(caplog.records) == 1 and "TensorBoard logging disabled" in caplog.records[0].getMessage()
    w.write(1, {"lm_loss": 1.0})
    w.close()
    assert (tmp_path / "m.jsonl").read_text().count("\n") == 1


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard", reason="tensorboard not installed (optional dependency)")
    with MetricsWriter(None, str(tmp_path / "tb"), rank=0) as w:
        assert w.tensorboard_enabled
        w.write(1, {"lm_loss": 1.0, "lr": 0.5, "note": "text is skipped"})
    events = list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0


def test_plot_metrics_writes_png(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed: tools/plot_metrics.py needs it")
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"iteration": i, "lm_loss": 10 - math.log(i), "lr": 1e-4 * i / 20, "tokens_per_s": 1000 + i})
             for i in range(1, 21)]
    lines.insert(10, json.dumps({"iteration": 10, "eval_lm_loss": 7.9}))
    path.write_text("\n".join(lines) + "\n{\"iteration\": 2")  # torn last line is ignored
    out = tmp_path / "curves.png"
    assert load_tool("plot_metrics").main([str(path), "--output", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000


def test_plot_metrics_draws_multi_token_prediction_and_experts_panels(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed: tools/plot_metrics.py needs it")
    import matplotlib.pyplot as plt

    records = [{"iteration": i, "lm_loss": 5.0 - i / 10, "lr": 1e-3, "tokens_per_s": 900.0, "mtp_1_loss": 5.5 - i / 10,
                "mtp_2_loss": 5.8 - i / 10, "moe_aux_loss": 0.02 + i / 1000, "expert_load_max_over_mean": 1 + i / 10}
               for i in range(1, 6)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    drawn, real_savefig = {}, plt.Figure.savefig

    def savefig(fig, *args, **kwargs):
        for ax in fig.axes:
            drawn[ax.get_ylabel()] = {line.get_label(): list(line.get_ydata()) for line in ax.lines}
        return real_savefig(fig, *args, **kwargs)

    plt.Figure.savefig = savefig
    try:
        assert load_tool("plot_metrics").main([str(path), "--output", str(tmp_path / "c.png")]) == 0
    finally:
        plt.Figure.savefig = real_savefig
    assert list(drawn) == ["lm loss", "learning rate", "tokens/s", "multi-token prediction loss", "moe aux loss",
                           "expert load"]
    assert drawn["multi-token prediction loss"] == {f"depth {d}": [r[f"mtp_{d}_loss"] for r in records] for d in (1, 2)}
    assert list(drawn["moe aux loss"].values()) == [[r["moe_aux_loss"] for r in records]]
    assert drawn["expert load"] == {"busiest / mean": [r["expert_load_max_over_mean"] for r in records]}


def test_multi_token_prediction_losses_sit_beside_the_lm_loss_and_in_tensorboard():
    from megazero.training.meters import IterationStats, format_log_lines, megatron_scalars

    stats = IterationStats(iteration=3, train_iters=9, consumed_samples=24, seconds_per_iteration=0.5, lr=1e-3,
                           global_batch_size=8, losses={"lm loss": 5.0, "mtp_1 loss": 5.25, "mtp_2 loss": 5.5,
                                                        "moe aux loss": 0.01})
    first, second = format_log_lines(stats)
    assert "| lm loss: 5.0000 | mtp_1 loss: 5.2500 | mtp_2 loss: 5.5000 | lr:" in first
    assert "mtp_" not in second and "moe aux loss" in second
    tags = {tag: value for tag, value, axis in megatron_scalars(stats.to_record(), None) if axis == "iteration"}
    assert tags["mtp_1 loss"] == 5.25 and tags["mtp_2 loss"] == 5.5
