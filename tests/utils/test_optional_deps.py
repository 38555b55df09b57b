"""Optional packages of the tools: a missing one is one line naming it and how to install it (the package
itself, or the megazero extra that declares it from the checkout), and exit status 2 (not a traceback
half-way through)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from megazero.utils.optional_deps import missing_packages, require_packages

ROOT = Path(__file__).resolve().parents[2]


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_missing_modules_are_named_as_pip_installs_them(monkeypatch):
    monkeypatch.setitem(sys.modules, "google.protobuf", None)  # as if protobuf were not installed
    assert missing_packages(["json", "google.protobuf", "no_such_package_megazero.sub"]) == [
        "protobuf", "no_such_package_megazero.sub"]


def test_require_packages_prints_one_line_and_exits_2(monkeypatch, capsys):
    require_packages("tool", ["json"], "hf")  # present: nothing happens
    monkeypatch.setitem(sys.modules, "google.protobuf", None)
    with pytest.raises(SystemExit) as e:
        require_packages("convert_to_hf", ["json", "google.protobuf"], "hf", "exporting a SentencePiece tokenizer")
    assert e.value.code == 2
    assert capsys.readouterr().err == ("convert_to_hf: error: exporting a SentencePiece tokenizer needs the protobuf "
                                       "package, which is not installed: pip install protobuf (or pip install -e "
                                       "'.[hf]' in the megazero checkout)\n")


def test_convert_to_hf_without_transformers_stops_before_reading(tmp_path, monkeypatch, capsys):
    tool = load_tool("convert_to_hf")
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(SystemExit) as e:
        tool.main(["--input", str(tmp_path / "nothing"), "--output", str(tmp_path / "hf")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the transformers package" in err
    assert "pip install transformers" in err and "pip install -e '.[hf]'" in err
    assert not (tmp_path / "hf").exists()


def test_plot_metrics_without_matplotlib(tmp_path, monkeypatch, capsys):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"iteration": 1, "lm_loss": 2.5}\n')
    tool = load_tool("plot_metrics")
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(SystemExit) as e:
        tool.main([str(metrics), "--output", str(tmp_path / "curves.png")])
    assert e.value.code == 2
    assert capsys.readouterr().err == ("plot_metrics: error: plotting needs the matplotlib package, which is not "
                                       "installed: pip install matplotlib (or pip install -e '.[plot]' in the megazero "
                                       "checkout)\n")
    assert not (tmp_path / "curves.png").exists()
