"""tools/plot_metrics.py finds where a run was resumed from the records of its metrics JSONL alone,
and draws the figure with a title and that mark."""

import json

import pytest

from megazero.cli.plot_metrics import RESTART_GAP_S, main as plot_metrics_main, resumes


def _run(iterations, start_s, step_ms=100.0, first=0):
    """The training records one process writes: a record every log interval, each ``timestamp`` the
    previous one plus the interval's iterations at ``step_ms``."""
    t, out, last = start_s, [], first
    for it in iterations:
        t += (it - last) * step_ms / 1000.0
        out.append({"iteration": it, "lm_loss": 5.0 - it / 1000, "elapsed_ms_per_iteration": step_ms, "timestamp": t})
        last = it
    return out


def test_one_process_has_no_resume_even_with_evaluation_inside_an_interval():
    records = _run([25, 50, 75, 100], 1000.0)
    records.insert(2, {"iteration": 50, "eval_lm_loss": 4.9, "timestamp": records[1]["timestamp"] + 3.0})
    assert resumes(records) == []


def test_a_restart_after_the_exit_interval_is_found_by_its_start_up_time():
    first = _run([25, 50, 75, 100, 125, 150], 1000.0)
    # the second process loads iteration 150 and logs 175 after its start-up (a few seconds)
    second = _run([175, 200], first[-1]["timestamp"] + 4 * RESTART_GAP_S, first=150)
    assert resumes(first + second) == [150]


def test_a_restart_from_an_earlier_checkpoint_rewinds_the_iterations():
    first = _run([25, 50, 75, 100, 125, 150, 175], 1000.0)  # crashed after 175; the checkpoint is at 100
    second = _run([125, 150], first[-1]["timestamp"] + 0.5, first=100)
    assert resumes(first + second) == [100]


def test_the_plot_has_a_title_and_the_resume_mark(tmp_path):
    pytest.importorskip("matplotlib", reason="matplotlib not installed: tools/plot_metrics.py needs it")
    path = tmp_path / "metrics.jsonl"
    first = _run([25, 50, 75], 1000.0)
    records = first + _run([100, 125], first[-1]["timestamp"] + 10.0, first=75)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    import matplotlib.pyplot as plt

    shown = {}
    real_savefig = plt.Figure.savefig

    def savefig(fig, *args, **kwargs):
        shown["title"] = fig._suptitle.get_text()
        shown["marks"] = [list(line.get_xdata()) for line in fig.axes[0].lines if line.get_linestyle() == "--"]
        return real_savefig(fig, *args, **kwargs)

    plt.Figure.savefig = savefig
    try:
        assert plot_metrics_main([str(path), "--output", str(tmp_path / "c.png")]) == 0
    finally:
        plt.Figure.savefig = real_savefig
    assert shown == {"title": str(path), "marks": [[75, 75]]}
