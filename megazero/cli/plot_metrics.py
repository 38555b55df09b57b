"""Plot a training run's metrics JSONL (written by megazero.training.meters.MetricsWriter).

    python tools/plot_metrics.py checkpoints/run/metrics.jsonl --output curves.png

Installed: ``megazero-plot-metrics``. Subplots against iteration: loss (train ``lm_loss``
and eval ``eval_lm_loss``), learning rate, tokens/s, and where the run has them the multi-token
prediction losses (``mtp_k_loss``, one curve per depth), a mixture of experts' auxiliary loss
(``moe_aux_loss``) and its experts' load (``expert_load_max_over_mean``, with
``moe_dropped_fraction`` under a capacity), under a title (``--title``, default the file's path),
with a dashed line where a later process resumed the run (see ``resumes``). Records missing a
key are skipped for that curve, so a run that logged no eval simply has no eval line. Needs
matplotlib (Agg backend, no display).
"""

from __future__ import annotations

import argparse
import json
import logging
import re
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


# A new process between two training records: more wall-clock time passed between them than their
# iterations took. Within one process the two agree to milliseconds (the interval's timer starts when
# the previous record is written, and evaluation and saving fall inside it); a restart adds the
# interpreter's start-up, the process groups and the checkpoint load, seconds at the least.
RESTART_GAP_S = 1.0
STEP_MS = "elapsed_ms_per_iteration"


def resumes(records: list[dict]) -> list[int]:
    """Where the run was resumed: per restart found in the training records (those with a numeric
    ``elapsed_ms_per_iteration``), the last iteration logged before it below the resumed process's
    first one, which is within one log interval at or before the checkpoint that process loaded. A
    restart is a record whose iteration does not exceed its predecessor's (a restart from an earlier
    checkpoint), or one written ``RESTART_GAP_S`` later than its iterations' time accounts for."""
    train = [r for r in records if "iteration" in r and isinstance(r.get(STEP_MS), (int, float))
             and isinstance(r.get("timestamp"), (int, float))]
    found = []
    for i in range(1, len(train)):
        prev, cur = train[i - 1], train[i]
        steps = cur["iteration"] - prev["iteration"]
        unexplained = cur["timestamp"] - prev["timestamp"] - steps * cur[STEP_MS] / 1000.0
        if steps <= 0 or unexplained > RESTART_GAP_S:
            before = [r["iteration"] for r in train[:i] if r["iteration"] < cur["iteration"]]
            if before:
                found.append(max(before))
    return found


def panels(records: list[dict]) -> list[tuple[str, list[tuple[str, str, str]]]]:
    """The figure's subplots, top to bottom: ``(y label, [(key, curve label, line style), ...])``. Loss,
    learning rate and tokens/s always; multi-token prediction and a mixture's panels when a record has their keys."""
    keys = {k for r in records for k in r}
    out = [("lm loss", [(TRAIN_LOSS, "train", "-"), (EVAL_LOSS, "eval", "o-")]),
           ("learning rate", [(LR, "", "-")]), ("tokens/s", [(TOKENS, "", "-")])]
    depths = sorted((int(m.group(1)) for m in map(re.compile(r"mtp_(\d+)_loss").fullmatch, keys) if m))
    if depths:
        out.append(("multi-token prediction loss", [(f"mtp_{d}_loss", f"depth {d}", "-") for d in depths]))
    if "moe_aux_loss" in keys:
        out.append(("moe aux loss", [("moe_aux_loss", "", "-")]))
    if "expert_load_max_over_mean" in keys:
        out.append(("expert load", [("expert_load_max_over_mean", "busiest / mean", "-"),
                                    ("moe_dropped_fraction", "dropped fraction", "-")]))
    return out


def plot(records: list[dict], output: str, title: Optional[str] = None) -> None:
    """Write the figure of ``records`` (:func:`panels`) to ``output`` (its format from the file name's suffix)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layout = panels(records)
    fig, axes = plt.subplots(len(layout), 1, figsize=(8, 2.6 * len(layout)), sharex=True)
    for ax, (ylabel, curves) in zip(axes, layout):
        for key, label, style in curves:
            x, y = series(records, key)
            if x:
                ax.plot(x, y, style, label=label or None, markersize=3)
        ax.set_ylabel(ylabel)
    for n, at in enumerate(resumes(records)):
        for ax in axes:
            ax.axvline(at, color="gray", linestyle="--", linewidth=1, label="resumed" if n == 0 and ax is axes[0] else None)
    for ax in axes:
        if any(not line.get_label().startswith("_") for line in ax.lines):  # a curve with a label
            ax.legend()
        ax.grid(True, alpha=0.3)
    axes[-1].set_xlabel("iteration")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(output, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    p.add_argument("metrics", help="metrics JSONL file")
    p.add_argument("--output", "-o", default="curves.png", help="image to write")
    p.add_argument("--title", help="title above the plots (default: the metrics file's path)")
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
    plot(records, a.output, a.title or a.metrics)
    marks = resumes(records)
    resumed = f"; resumed after iteration {', '.join(map(str, marks))}" if marks else ""
    log.info("wrote %s (%d records%s)", a.output, len(records), resumed)
    return 0
