"""The package itself: its version (one place, read by pyproject.toml) and the torch floor checked at import."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import megazero
from megazero import TORCH_FLOOR, check_torch_version, parse_version

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("version, expected", [
    ("2.13.0", (2, 13, 0)),
    ("2.13.0+cpu", (2, 13, 0)),
    ("2.6.0+cu124", (2, 6, 0)),
    ("2.6.0a0+git1234", (2, 6, 0)),
    ("2.6.0a0+ecf3bae40a", (2, 6, 0)),  # NGC
    ("2.5.0.dev20240901", (2, 5, 0)),  # nightly
    ("2.7.0rc1", (2, 7, 0)),
    ("2.6.0.post1", (2, 6, 0)),
    ("2.10", (2, 10)),
    ("1!2.6.0", (2, 6, 0)),
    (" 2.6.0\n", (2, 6, 0)),
    ("unknown", ()),
    ("", ()),
])
def test_parse_version(version, expected):
    assert parse_version(version) == expected


@pytest.mark.parametrize("version", ["2.6.0", "2.6", "2.6.0a0+git1234", "2.6.0.dev20241101", "2.13.0+cpu",
                                     "2.10.1", "3.0.0", "weird"])
def test_new_enough_torch_passes(version):
    check_torch_version(version)


@pytest.mark.parametrize("version", ["2.5.1+cu124", "2.5.0.dev20240901", "2.4.0", "1.13.1", "2"])
def test_old_torch_is_one_line_with_the_fix(version):
    floor = ".".join(map(str, TORCH_FLOOR))
    with pytest.raises(ImportError) as e:
        check_torch_version(version)
    message = str(e.value)
    assert "\n" not in message
    assert message.startswith(f"megazero needs torch>={floor} (found {version}): pip install 'torch>={floor}'")
    assert "pytorch.org" in message


def test_the_installed_torch_passes():
    import torch

    check_torch_version()
    assert parse_version(torch.__version__) >= TORCH_FLOOR


def _python(code: str, pythonpath: list[Path]) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(map(str, pythonpath))}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_the_import_check_reads_torch_version_without_importing_torch():
    run = _python("import sys, megazero; v = megazero._installed_torch_version(); assert 'torch' not in sys.modules; "
                  "import torch; assert v == torch.__version__, (v, torch.__version__); print(v)", [ROOT])
    assert run.returncode == 0, run.stderr


def test_importing_megazero_with_an_old_torch_fails_in_one_line(tmp_path):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('the check must not import torch')\n")
    (fake / "version.py").write_text("from typing import Optional\n\n__version__ = '2.5.1+cu124'\n")
    run = _python("import megazero", [tmp_path, ROOT])
    assert run.returncode == 1
    floor = ".".join(map(str, TORCH_FLOOR))
    assert run.stderr.strip().splitlines()[-1] == (
        f"ImportError: megazero needs torch>={floor} (found 2.5.1+cu124): pip install 'torch>={floor}' "
        f"(pick the build for your CUDA at https://pytorch.org/get-started/locally/)")


def test_version_is_the_installed_metadata():
    try:
        installed = importlib.metadata.version("megazero")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("megazero is not installed here (pip install -e . from the checkout)")
    assert megazero.__version__ == installed


def test_pyproject_torch_floor_is_the_import_check():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert "version" in project["dynamic"] and "version" not in project
    torch_reqs = [r for r in project["dependencies"] if re.match(r"torch\b", r)]
    floor = ".".join(map(str, TORCH_FLOOR))
    # every pre-release of the floor counts, as in parse_version; no upper bound, no pin
    assert torch_reqs == [f"torch>={floor}.0.dev0"]
    assert all("pytest" not in r for r in project["dependencies"])
