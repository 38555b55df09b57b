"""Plot a training run's metrics JSONL (written by megazero.training.metrics.MetricsWriter).

    python tools/plot_metrics.py checkpoints/run/metrics.jsonl --output curves.png

Installed: ``megazero-plot-metrics``. Subplots against iteration: loss (train ``lm_loss``
and eval ``eval_lm_loss``), learning rate, tokens/s. Records missing a key are skipped for
that curve, so a run that logged no eval simply has no eval line. Needs matplotlib (Agg
backend, no display).
"""

from __future__ import annotations

import argparse
import json
import logging
from typing import Optional, Sequence

from megazero.cli.common import setup_logging, tool_parser
from megazero.utils.optional_deps import require_packages  # (stdlib only: no torch)

log = logging.getLogger(__name__)

TRAIN_LOSS, EVAL_LOSS, LR, TOKENS = "lm_loss", "eval_lm_loss", "lr", "tokens_per_s"


def read_metrics(path: str) -> list[dict]:
    """The JSON objects of a JSONL file; a torn last line (run killed mid-write) is ignored."""
    records = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON object") from None
    return records


def series(records: list[dict], key: str) -> tuple[list[int], list[float]]:
    """(iterations, values) of the records that have a numeric ``key``."""
    pts = [(r["iteration"], r[key]) for r in records
           if "iteration" in r and isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot(records: list[dict], output: str, title: Optional[str] = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    loss_ax, lr_ax, tok_ax = axes
    for key, label, style in ((TRAIN_LOSS, "train", "-"), (EVAL_LOSS, "eval", "o-")):
        x, y = series(records, key)
        if x:
            loss_ax.plot(x, y, style, label=label, markersize=3)
    loss_ax.set_ylabel("lm loss")
    if loss_ax.lines:
        loss_ax.legend()
    for ax, key, label in ((lr_ax, LR, "learning rate"), (tok_ax, TOKENS, "tokens/s")):
        x, y = series(records, key)
        if x:
            ax.plot(x, y)
        ax.set_ylabel(label)
    for ax in axes:
        ax.grid(True, alpha=0.3)
    tok_ax.set_xlabel("iteration")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    p.add_argument("metrics", help="metrics JSONL file")
    p.add_argument("--output", "-o", default="curves.png", help="image to write")
    p.add_argument("--title", help="title above the plots")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    a = build_parser().parse_args(argv)
    setup_logging()
    require_packages("plot_metrics", ["matplotlib"], "plot", "plotting")
    try:
        records = read_metrics(a.metrics)
    except (OSError, ValueError) as e:
        log.error("error: %s", e)
        return 2
    if not records:
        log.error("error: %s holds no records", a.metrics)
        return 2
    plot(records, a.output, a.title)
    log.info("wrote %s (%d records)", a.output, len(records))
    return 0
