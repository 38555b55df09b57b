"""Progress of the long-running programs: one helper (megazero.utils.progress), periodic lines through logging
when stderr is no terminal, seen here through each program on tiny inputs (a line at every step with
MEGAZERO_PROGRESS_INTERVAL=0)."""

from __future__ import annotations

import io
import logging
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from megazero.utils.progress import Progress
from tests.cli.programs import ROOT, program
from tests.launch import in_pool

TINY_GPT = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--mock-data",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64"]


@pytest.fixture
def every_step(monkeypatch):
    monkeypatch.setenv("MEGAZERO_PROGRESS_INTERVAL", "0")


def _run(args: list[str], timeout: int = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEGAZERO_PROGRESS_INTERVAL": "0", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


# ---- the helper -----------------------------------------------------------------------------------

def test_lines_count_percent_and_time_left(caplog):
    log = logging.getLogger("megazero.test_progress")
    with caplog.at_level(logging.INFO, logger=log.name):
        with Progress("converted", total=4, unit="layers", logger=log, interval=0.0, tty=False) as p:
            for _ in range(4):
                p.update()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 4  # one per step; the last one is not repeated at the end
    assert re.fullmatch(r"converted 1/4 layers \(25%\), \d+ s elapsed, ~\d+ s left", lines[0])
    assert re.fullmatch(r"converted 4/4 layers \(100%\), \d+ s elapsed", lines[-1])


def test_quiet_when_faster_than_the_interval_and_a_last_line_after_slow_ones(caplog):
    log = logging.getLogger("megazero.test_progress")
    with caplog.at_level(logging.INFO, logger=log.name):
        with Progress("read", unit="files", logger=log, interval=3600.0, tty=False) as p:
            p.update(3)
        assert not caplog.records
        p = Progress("read", unit="files", logger=log, interval=0.0, tty=False)
        p.update(postfix="a.pt")
        p.interval = 3600.0
        p.update(2, postfix="c.pt")
        p.close()
    assert [r.getMessage().split(",")[0] for r in caplog.records] == ["read 1 files", "read 3 files"]
    assert caplog.records[-1].getMessage().endswith(", c.pt")


def test_no_last_line_after_a_failure_and_none_when_disabled(caplog):
    log = logging.getLogger("megazero.test_progress")
    with caplog.at_level(logging.INFO, logger=log.name):
        with pytest.raises(RuntimeError):
            with Progress("merged", total=3, logger=log, interval=0.0, tty=False) as p:
                p.update()
                p.interval = 3600.0
                p.update()
                raise RuntimeError
        with Progress("merged", total=3, logger=log, interval=0.0, enabled=False, tty=False) as p:
            p.update(3)
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == ["merged 1/3"]
    assert p.done == 3


def test_a_terminal_gets_a_bar_and_no_lines(caplog, monkeypatch):
    bar = io.StringIO()
    monkeypatch.setattr(sys, "stderr", bar)
    with caplog.at_level(logging.INFO, logger="megazero.progress"):
        with Progress("tokenized", total=2, unit="documents", interval=0.0, tty=True) as p:
            p.update(2, postfix="1.0 MB/s")
    assert not caplog.records
    assert "tokenized" in bar.getvalue() and "2/2" in bar.getvalue()


# ---- through the programs -------------------------------------------------------------------------

def test_merge_datasets(tmp_path, every_step, capsys):
    from megazero.data.indexed_dataset import IndexedDatasetBuilder

    for i in range(3):
        b = IndexedDatasetBuilder(str(tmp_path / f"s{i}.bin"), np.uint16)
        b.add_item(np.arange(i + 1))
        b.end_document()
        b.finalize(str(tmp_path / f"s{i}.idx"))
    assert program("merge_datasets").main(["--input", str(tmp_path), "--output-prefix", str(tmp_path / "all")]) == 0
    out, err = capsys.readouterr()
    assert "merged 1/3 datasets (33%)" in err and "merged 3/3 datasets (100%)" in err
    assert "merged 3 datasets ->" in out  # the summary stays on stdout


def test_preprocess_data(tmp_path, every_step, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text("".join(f'{{"text": "{i} {i}"}}\n' for i in range(3)))
    assert program("preprocess_data").main(["--input", str(src), "--output-prefix", str(tmp_path / "o"),
                                            "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
                                            "--log-interval", "2"]) == 0
    err = capsys.readouterr().err
    assert "tokenized 1 documents," in err and "tokenized 3 documents," in err
    assert re.search(r"tokenized 2 documents, \d+ s elapsed, [\d.]+ MB/s, [\d,]+ tok/s", err)


def test_hf_conversions_report_layers(tmp_path, every_step, capsys, monkeypatch):
    pytest.importorskip("transformers")
    from megazero.model import GPTModel
    from megazero.model.state_dict import gather_full_state_dict, save_full
    from tests.model.common import tiny_config

    config = tiny_config("gpt", num_layers=3)
    save_full(str(tmp_path / "mz"), gather_full_state_dict(GPTModel(config)), config)
    assert program("convert_to_hf").main(["--load", str(tmp_path / "mz"), "--output", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert "converted 1/3 layers (33%)" in err and "converted 3/3 layers (100%)" in err
    assert program("convert_from_hf").main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "back")]) == 0
    err = capsys.readouterr().err
    assert "converted 1/3 layers (33%)" in err and "converted 3/3 layers (100%)" in err
    monkeypatch.delenv("MEGAZERO_PROGRESS_INTERVAL")  # the default interval: nothing on a run this short
    assert program("convert_to_hf").main(["--load", str(tmp_path / "back"), "--output", str(tmp_path / "hf2")]) == 0
    assert "converted" not in capsys.readouterr().err


def test_convert_from_megatron_reports_files(tmp_path, every_step, capsys):
    from tests.model.test_megatron_import import _args, _full_megatron_weights, write_megatron_lm

    a = _args("gpt", 2, 1)
    full, groups = _full_megatron_weights(a)
    (tmp_path / "megatron").mkdir()
    write_megatron_lm(tmp_path / "megatron", a, full, groups)
    assert program("convert_from_megatron").main(["--input", str(tmp_path / "megatron"),
                                                  "--output", str(tmp_path / "mz")]) == 0
    err = capsys.readouterr().err
    assert re.search(r"read 1 checkpoint files, \d+ s elapsed, model_optim_rng.pt", err)
    assert "read 2 checkpoint files" in err


def test_estimate_memory_reports_the_plans_it_tries(every_step, capsys):
    assert program("estimate_memory").main("--model-preset 13b --tp 1 --world-size 8 --device-memory-gb 80".split()) == 1
    err = capsys.readouterr().err
    assert re.search(r"estimated 1/(\d+) alternative plans .*\n(.*\n)*estimated (\1)/\1 alternative plans \(100%\)", err)
    assert "error: the plan needs" in err


def test_rehearse_reports_ranks():
    proc = _run(["tools/rehearse.py", "--world-size", "2", "--", *TINY_GPT, "--global-batch-size", "2",
                 "--train-iters", "4"])
    assert proc.returncode == 0, proc.stderr
    assert "rehearsed 1/2 ranks (50%)" in proc.stderr and "rehearsed 2/2 ranks (100%)" in proc.stderr
    assert proc.stderr.count("rehearsed 2/2") == 1
    assert re.findall(r"^rank (\d+) ", proc.stdout, re.M) == ["0", "1"]  # the reports stay on stdout
    # rank 0's own training lines (logged by the loop) are the rehearsal's capture: shown with --verbose only
    assert "> model:" not in proc.stdout + proc.stderr and "lm loss" not in proc.stdout + proc.stderr


def test_generate_reports_tensors_loaded(tmp_path):
    every_step = {"MEGAZERO_PROGRESS_INTERVAL": "0"}
    train = in_pool(1, [*TINY_GPT, "--global-batch-size", "1", "--train-iters", "1", "--save", str(tmp_path / "ckpt"),
                        "--save-interval", "1", "--eval-iters", "0"], env=every_step)
    assert train.returncode == 0, train.stderr[-3000:]
    proc = in_pool(1, ["--load", str(tmp_path / "ckpt"), "--max-new-tokens", "2"], script="tools/generate.py",
                   env=every_step)
    assert proc.returncode == 0, proc.stderr
    loaded = re.findall(r"loaded (\d+)/(\d+) tensors", proc.stderr)
    assert loaded and loaded[0][0] == "1" and loaded[-1][0] == loaded[-1][1]
    assert proc.stdout.strip() and "loaded" not in proc.stdout  # the text alone on stdout


@pytest.mark.slow
def test_pretrain_gpt_reports_the_evaluation_batches():
    run = in_pool(1, [*TINY_GPT, "--global-batch-size", "1", "--train-iters", "2", "--eval-interval", "2",
                      "--eval-iters", "3", "--log-interval", "1"], env={"MEGAZERO_PROGRESS_INTERVAL": "0"})
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    for split in ("validation", "test"):
        assert re.search(rf"^evaluated 1/3 {split} batches \(33%\), \d+ s elapsed, ~\d+ s left$", run.stdout, re.M)
        assert re.search(rf"^evaluated 3/3 {split} batches \(100%\), \d+ s elapsed$", run.stdout, re.M)
    last_test = max(i for i, line in enumerate(lines) if line.startswith("evaluated 3/3 test batches"))
    assert "end of training for test data" in lines[last_test + 1]  # the progress, then the result
