"""benchmarks/bench_window.py: a tiny run prints both tables, and the ring's pairs per rank are the window's."""

from benchmarks import bench_window


def test_tiny_run_prints_the_tables(caplog):
    caplog.set_level("INFO", logger="bench_window")
    assert bench_window.main(["--tiny"]) == 0
    text = caplog.text
    assert "| 256 | 15 |" in text and "| 256 | full |" in text
    assert "| 1024 | 15 | 4,096 | 131,200 | 0.031 | halo |" in text  # cp 4: 256 tokens a rank, 16 keys at most
