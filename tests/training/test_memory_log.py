"""The log line's memory figure: the step's peak, labelled with what measured it."""

import contextlib
import io
import json

from megazero.training.loop import Callback
from megazero.training.meters import IterationStats, format_log_line
from tests.distributed import run_distributed


def test_labels_name_the_source():
    stats = IterationStats(iteration=1, train_iters=1, consumed_samples=8, seconds_per_iteration=0.1, lr=1e-3,
                           global_batch_size=8, losses={}, memory_mb=12.0)
    for source, label in (("tracked_peak_live", "peak memory (tracked live tensors): 12 MiB"),
                          ("rss", "memory (RSS): 12 MiB"),
                          ("cuda_peak_allocated", "peak memory: 12 MiB")):
        stats.peak_memory_source = source
        assert label in format_log_line(stats)
        assert stats.to_record()["peak_memory_source"] == source


class ModelState(Callback):
    """The engine's model state bytes before each step (the last one's is kept)."""

    def __init__(self):
        self.run, self.bytes = None, None

    def on_train_start(self, state, run):
        self.run = run

    def on_step_start(self, state, batches):
        self.bytes = self.run.engine.model_state_bytes()["total"]


def _train(metrics, track):
    import torch.distributed as dist

    from megazero.config import parse_args
    from megazero.utils.output import console
    from megazero.training.trainer import pretrain

    args = ["--tp", "1", "--zero-stage", "3", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
            "4", "--seq-length", "16", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
            "--mock-data", "--vocab-size", "64", "--log-interval", "1", "--eval-iters", "0",
            "--metrics-file", metrics] + (["--track-memory"] if track else [])
    measured = ModelState()
    out = io.StringIO()
    # The log on stdout, as pretrain_gpt.py shows it.
    with contextlib.redirect_stdout(out), console("megazero.training"):
        pretrain(parse_args(args, 2), callbacks=[measured])
    return dist.get_rank(), measured.bytes, out.getvalue()


def test_track_memory_logs_the_tracked_peak(tmp_path):
    metrics = str(tmp_path / "m.jsonl")
    results = run_distributed(2, _train, metrics, True)
    rank0 = [r for r in results if r[0] == 0][0]
    _, model_state, log = rank0
    assert "peak memory (tracked live tensors):" in log
    records = [json.loads(line) for line in open(metrics)]
    train = [r for r in records if "memory_mb" in r]
    assert len(train) == 2 and all(r["peak_memory_source"] == "tracked_peak_live" for r in train)
    for r in train:  # the peak holds at least the persistent model state, plus the step's transients
        assert r["memory_mb"] * 2 ** 20 >= model_state > 0
    # without the flag the CPU figure is the resident set size, and the label says so
    _, _, log = [r for r in run_distributed(2, _train, str(tmp_path / "n.jsonl"), False) if r[0] == 0][0]
    assert "memory (RSS):" in log and "tracked live tensors" not in log
