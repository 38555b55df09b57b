"""Where the programs write: their product on stdout, diagnostics through logging on stderr; and the quickstart's
launch lines."""

from __future__ import annotations

import logging
import os
import re

import pytest

from megazero.cli.common import setup_logging
from tests.cli.programs import ROOT, program


def test_diagnostics_go_through_logging_and_the_product_to_stdout(tmp_path, capsys, caplog):
    with caplog.at_level(logging.INFO, logger="megazero"):
        assert program("merge_datasets").main(["--input", str(tmp_path / "nope"),
                                               "--output-prefix", str(tmp_path / "x")]) == 1
    out, err = capsys.readouterr()
    assert not out and "error: " in err and "not found" in err
    assert [(r.name, r.levelname) for r in caplog.records] == [("megazero.cli.merge_datasets", "ERROR")]
    assert program("estimate_memory").main("--model-preset 13b --tp 4 --world-size 64 --zero-stage 3 --bf16".split()) == 0
    out, err = capsys.readouterr()
    assert "parameters:" in out and not err


def test_logging_setup_is_idempotent_and_adds_no_second_stderr_handler(monkeypatch):
    log = logging.getLogger("megazero")
    setup_logging()
    setup_logging()
    ours = [h for h in log.handlers if type(h).__name__ == "_StderrHandler"]
    assert len(ours) == 1
    monkeypatch.setattr(log, "handlers", [])  # as if an application had configured logging to stderr first
    root_handler = logging.StreamHandler()  # writes to sys.stderr
    monkeypatch.setattr(logging.getLogger(), "handlers", [root_handler])
    setup_logging()
    assert log.handlers == []  # records reach stderr once, through the application's handler


def test_quickstart_passes_nproc_per_node_once_per_launch():
    text = (ROOT / "examples" / "quickstart_cpu.sh").read_text()
    lines = text.replace("\\\n", " ").splitlines()
    definition = next(ln for ln in lines if re.match(r"\s*torchrun=\(", ln)).split("#")[0]
    assert "--nproc_per_node" not in definition
    launches = [ln for ln in lines if '"${torchrun[@]' in ln]
    assert len(launches) == 3
    for line in launches:
        assert line.count("--nproc_per_node") == 1, line
        assert '"${torchrun[@]}"' in line, line  # the whole array, no pattern substitution


def test_programs_write_through_write_output_or_logging():
    """No bare print: a program's product goes through common.write_output (stdout), everything
    else through its module logger (stderr)."""
    import ast

    offenders = []
    for path in sorted((ROOT / "megazero" / "cli").glob("*.py")):
        if path.stem in ("pretrain_gpt", "generate"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
                offenders.append(f"{path.name}:{node.lineno}")
    assert not offenders, "print() in megazero/cli: use write_output (the product) or log.info: " + ", ".join(offenders)


def _last_words(output: str) -> str:
    """The last line with text in it: torchrun closes its summary with a rule of '='."""
    return [line for line in output.splitlines() if line.strip().strip("=")][-1]


@pytest.mark.slow
def test_a_failure_under_torchrun_ends_the_output_with_its_one_line(tmp_path):
    from tests import background
    from tests.launch import command

    tiny = ["--model-preset", "gpt-tiny", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters", "2"]
    (tmp_path / "bad.bin").write_bytes(b"\0" * 64)
    (tmp_path / "bad.idx").write_bytes(b"not an index")
    # the three launches side by side (tests/launch.py's launch(), in the background)
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    launches = ((1, [*tiny, "--mock-data", "--tp", "3"]), (2, [*tiny, "--mock-data", "--tp", "3"]),
                (2, [*tiny, "--data-path", str(tmp_path / "bad"), "--tokenizer-type", "NullTokenizer",
                     "--vocab-size", "64"]))
    alone, refused, failed = [background.run(command(world) + argv, env, timeout=300, cwd=str(ROOT))
                              for world, argv in launches]
    alone, refused, failed = alone.result(), refused.result(), failed.result()
    message = "world size 1 is not divisible by --tp 3 x --pp 1 = 3"
    assert alone.returncode == 2 and message in _last_words(alone.stdout + alone.stderr), alone.stderr
    # torchrun exits 1 whenever a worker fails; its summary's root cause is rank 0's 2 and our line
    root = refused.stderr.split("Root Cause")[-1]
    assert refused.returncode == 1 and "exitcode  : 2 " in root, refused.stderr
    assert _last_words(refused.stdout + refused.stderr).endswith(
        "traceback : error: world size 2 is not divisible by --tp 3 x --pp 1 = 3; launch a multiple of 3 processes "
        "or change --tp"), refused.stderr
    last = _last_words(failed.stdout + failed.stderr)
    assert failed.returncode == 1 and "exitcode  : 1 " in failed.stderr.split("Root Cause")[-1], failed.stderr
    assert "traceback : pretrain_gpt.py: data set-up failed on rank 0:" in last and "bad.idx" in last, failed.stderr
