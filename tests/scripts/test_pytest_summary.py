"""The count of passed tests stays in the output however many -q are given: pyproject's addopts says -q
already, so the -q of ``scripts/test.sh --quick -q`` (pytest's -qq) would otherwise drop it."""

import subprocess
import sys

from tests.launch import ROOT


def test_the_pass_count_shows_with_a_second_q():
    # what scripts/test.sh --quick -q runs, on one quick test
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider",
                           "tests/test_package.py::test_pyproject_torch_floor_is_the_import_check"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "1 passed" in proc.stdout, proc.stdout
