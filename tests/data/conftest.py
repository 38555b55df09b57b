"""Shared fixtures of the data-pipeline tests: tiny corpora and one small tokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from megazero.data.tokenizer_training import train_sentencepiece

# Enough varied text for a 320-piece SentencePiece model to train in well under a second.
SAMPLE_TEXTS = [
    "To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer\n",
    "The slings and arrows of outrageous fortune,\nOr to take arms against a sea of troubles\n",
    "And by opposing end them. To die -- to sleep,\nNo more; and by a sleep to say we end\n",
    "Now is the winter of our discontent\nMade glorious summer by this sun of York;\n",
    "All the world's a stage,\nAnd all the men and women merely players;\n",
    "Friends, Romans, countrymen, lend me your ears;\nI come to bury Caesar, not to praise him.\n",
] * 20


def write_jsonl(path: Path, rows: list, raw_lines: list[bytes] | None = None) -> Path:
    """Rows (dicts) as JSONL; ``raw_lines`` are appended verbatim (for bad-input tests)."""
    with open(path, "wb") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False).encode() + b"\n")
        for raw in raw_lines or []:
            f.write(raw)
    return path


@pytest.fixture(scope="session")
def spm_model(tmp_path_factory) -> str:
    """A small lossless SentencePiece model (vocab 320), trained once per test session."""
    out = tmp_path_factory.mktemp("spm") / "tiny"
    return train_sentencepiece(SAMPLE_TEXTS, str(out), 320, num_threads=1)


@pytest.fixture
def null_jsonl(tmp_path) -> tuple[Path, list[list[int]]]:
    """A JSONL of NullTokenizer documents (space-separated ids) and their ids."""
    docs = [[1, 2, 3], [4, 5], [], [6, 7, 8, 9], [10]]
    path = write_jsonl(tmp_path / "null.jsonl", [{"text": " ".join(map(str, d))} for d in docs])
    return path, docs
