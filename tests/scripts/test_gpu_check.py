"""scripts/gpu_check.sh, the CUDA acceptance check: its dry run on the CPU (GPU_CHECK_DEVICE=cpu)
runs every check that can run there and passes; every check asserts (none only prints); a failing
check makes the script exit 1."""

from __future__ import annotations

import ast
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.py"
ON_CPU = ("two_ranks_offload", "two_ranks_native", "slow_collectives", "offload_bitwise", "ring_kernels", "moe_layer")
CUDA_ONLY = ("ring_kernels_dropout", "attention_backends", "recurrent_kernels", "apex_adam", "throughput_1p3b", "async_save", "muon_step",
             "nccl_watchdog")


def _module():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dry_run_on_the_cpu_passes_what_runs_there():
    env = {**os.environ, "GPU_CHECK_DEVICE": "cpu", "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=240)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    for name in ON_CPU:
        assert f"PASS {name} " in r.stdout, out[-4000:]
    for name in CUDA_ONLY:
        assert f"SKIP {name} " in r.stdout, out[-4000:]
    assert "collectives completed late on wait() (CPU); bit-identical" in r.stdout
    assert "summary: 6 passed, 0 failed, 8 skipped" in r.stdout


def test_every_check_asserts_and_the_script_runs_the_module():
    tree = ast.parse(SCRIPT.read_text())
    funcs = {f.name: f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef)}
    names = [n for n, _ in _module().CHECKS]
    assert sorted(names) == sorted(ON_CPU + CUDA_ONLY)
    for name in names:
        body = funcs[f"check_{name}"]
        asserts = [n for n in ast.walk(body) if isinstance(n, ast.Assert)]
        assert asserts, f"check_{name} asserts nothing"
        assert all(a.msg is not None for a in asserts), f"check_{name} has an assert without a message"
    shell = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert 'scripts/gpu_check.py "$@"' in shell and "<<" not in shell  # no unchecked inline Python


def test_a_failing_check_fails_the_run(monkeypatch, capsys):
    m = _module()

    def broken():
        assert 1 == 2, "the numbers differ"

    monkeypatch.setenv("GPU_CHECK_DEVICE", "cpu")
    monkeypatch.setattr(m, "CHECKS", [("broken", broken), ("skipped", m.check_attention_backends)])
    assert m.main() == 1
    out = capsys.readouterr().out
    assert "FAIL broken " in out and "AssertionError: the numbers differ" in out
    assert "SKIP skipped " in out and "summary: 0 passed, 1 failed, 1 skipped" in out


def test_throughput_figures_parsed_and_peaks_known(monkeypatch):
    m = _module()
    line = (" iteration        8/       8 | elapsed time per iteration (ms): 500.0 | tokens/s: 262144 |"
            " TFLOP/s per rank: 412.5 | learning rate: 1.000E-04")
    assert m.parse_throughput("noise\n" + line) == (262144.0, 412.5)
    with pytest.raises(AssertionError, match="no 'tokens/s"):
        m.parse_throughput("no log line")
    assert m.peak_tflops("NVIDIA H200") == 989.0 and m.peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert m.peak_tflops("Some GPU") is None
    monkeypatch.setenv("GPU_CHECK_PEAK_TFLOPS", "500")
    assert m.peak_tflops("Some GPU") == 500.0
    cmd = m.throughput_command(8)
    assert cmd[cmd.index("--model-preset") + 1] == "gpt-1.3b" and cmd[cmd.index("--nproc_per_node") + 1] == "8"
    assert cmd[cmd.index("--eval-iters") + 1] == "0" and "--bf16" in cmd and "--log-throughput" in cmd
