"""benchmarks/bench_recurrent.py: a tiny run prints its three tables, megazero's kernels agree with transformers'
on the benchmark's inputs, and the bytes the context-parallel ranks send are the planner's."""

import re
from pathlib import Path

from benchmarks import bench_recurrent

ROOT = Path(__file__).resolve().parents[2]


def test_tiny_run_prints_the_tables(monkeypatch, caplog):
    # the exchange's ranks are processes of their own; the script imports its sibling module as it runs, from
    # benchmarks/
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    caplog.set_level("INFO", logger="bench_recurrent")
    assert bench_recurrent.main(["--tiny"]) == 0
    text = caplog.text
    diffs = re.findall(r"\| (?:gated delta rule|SSD) \|.*\| ([\d.e+-]+) \|$", text, re.M)
    assert len(diffs) == 2 and all(float(d) < 1e-5 for d in diffs), text
    assert re.search(r"^\| 256 \| \d+ \| \d+ \| [\d.]+x", text, re.M) and re.search(r"^\| 512 \| ", text, re.M)
    rows = re.findall(r"^\| (Gated DeltaNet|Mamba-2) \| (\w+) \| 2 \| (\d+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| "
                      r"(\w+) \|$", text, re.M)
    assert len(rows) == 8 and {r[-1] for r in rows} == {"agrees"}, text
    for mixer in ("Gated DeltaNet", "Mamba-2"):
        passing = {r[2]: r[3] for r in rows if r[:2] == (mixer, "state_passing")}
        assert passing["256"] == passing["512"]  # the sequence does not count
        heads = {r[2]: float(r[3]) for r in rows if r[:2] == (mixer, "a2a")}
        assert heads["512"] == 2 * heads["256"]  # Megatron's all-to-all grows with it
