"""Tokenizers round-trip text exactly and fail with messages naming the flag to fix."""

from __future__ import annotations

import json
import pickle

import pytest

from megazero.data.tokenizer import (
    GPT2BPETokenizer, HuggingFaceTokenizer, SentencePieceTokenizer, build_tokenizer,
)
from megazero.data.tokenizer_training import MAX_PIECE_BYTES, split_for_training, train_sentencepiece
from tests.data.conftest import SAMPLE_TEXTS, write_jsonl

HARD_TEXTS = [
    "two  spaces,   three, and trailing   ",
    "   leading spaces",
    "\nleading newline\n\n\nthree newlines\n",
    "tabs\tand\t\tmore tabs\t",
    "unicode: café, naïve, Ærø, 東京, Ελληνικά, emoji 😀🎭 and ﬁ ligature",
    "literal specials </s> <s> <unk> <0x0A> <|endoftext|>",
    "\r\nwindows line end\r\n",
    "",
]


def test_sentencepiece_round_trip(spm_model):
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model)
    assert isinstance(tok, SentencePieceTokenizer)
    for text in HARD_TEXTS + SAMPLE_TEXTS[:6]:
        ids = tok.tokenize(text)
        assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids)
        assert tok.detokenize(ids) == text
    assert tok.eod == 2 and tok.vocab_size == 320
    assert tok.tokenize("a\nb").count(tok.tokenize("\n")[0]) == 1  # newline is one symbol
    clone = pickle.loads(pickle.dumps(tok))
    assert clone.tokenize(HARD_TEXTS[4]) == tok.tokenize(HARD_TEXTS[4])


def test_split_for_training_respects_limit_and_utf8():
    text = "short line\n" + ("word " * 2000) + "\n" + ("é" * 5000) + "\n\n"
    pieces = list(split_for_training(text))
    assert all(0 < len(p.encode()) <= MAX_PIECE_BYTES for p in pieces)
    assert "".join(pieces).replace(" ", "") == text.replace("\n", "").replace(" ", "")


def test_long_documents_still_train(tmp_path):
    # Every line is > 4 KB: without splitting, SentencePiece would drop all of them.
    words = ["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]
    docs = [" ".join(words[(i * j) % 8] for j in range(1500)) for i in range(1, 9)]
    assert min(len(d.encode()) for d in docs) > 4192
    tok = SentencePieceTokenizer(train_sentencepiece(docs, str(tmp_path / "long"), 300, num_threads=1))
    assert len(tok.tokenize(" charlie foxtrot")) == 2  # whole words were learned
    assert tok.detokenize(tok.tokenize(docs[0])) == docs[0]


def test_train_tokenizer_cli(tmp_path, capsys):
    from tools.train_tokenizer import main

    src = write_jsonl(tmp_path / "c.jsonl", [{"body": t} for t in SAMPLE_TEXTS])
    prefix = tmp_path / "out" / "spm"
    assert main(["--input", str(src), "--json-key", "body", "--vocab-size", "300",
                 "--output-prefix", str(prefix)]) == 0
    tok = SentencePieceTokenizer(f"{prefix}.model")
    assert tok.vocab_size == 300 and tok.detokenize(tok.tokenize(HARD_TEXTS[4])) == HARD_TEXTS[4]
    assert not list((tmp_path / "out").glob("*.tmp*"))
    # A missing key is reported with file and line.
    assert main(["--input", str(src), "--vocab-size", "300", "--output-prefix", str(prefix)]) == 1
    assert f"{src}:1: missing key 'text'" in capsys.readouterr().err


def _tiny_bytelevel_bpe(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    bpe = ByteLevelBPETokenizer(add_prefix_space=False)
    bpe.train_from_iterator(SAMPLE_TEXTS, vocab_size=400, min_frequency=1,
                            special_tokens=["<|endoftext|>"], show_progress=False)
    bpe.save_model(str(tmp_path))  # writes vocab.json + merges.txt
    return bpe


def test_gpt2_bpe_round_trip(tmp_path):
    _tiny_bytelevel_bpe(tmp_path)
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=tmp_path / "vocab.json",
                          merge_file=tmp_path / "merges.txt")
    assert isinstance(tok, GPT2BPETokenizer)
    for text in HARD_TEXTS:
        assert tok.detokenize(tok.tokenize(text)) == text
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert tok.eod == vocab["<|endoftext|>"] and tok.vocab_size == len(vocab)
    assert pickle.loads(pickle.dumps(tok)).tokenize("To be") == tok.tokenize("To be")


def test_huggingface_directory_round_trip(tmp_path):
    bpe = _tiny_bytelevel_bpe(tmp_path)
    hf_dir = tmp_path / "hf"
    hf_dir.mkdir()
    bpe.save(str(hf_dir / "tokenizer.json"))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    assert isinstance(tok, HuggingFaceTokenizer)
    for text in HARD_TEXTS:
        assert tok.detokenize(tok.tokenize(text)) == text
    assert tok.eod == bpe.token_to_id("<|endoftext|>")


def test_huggingface_via_transformers(tmp_path):
    """A directory without tokenizer.json (slow-tokenizer files) loads through transformers."""
    pytest.importorskip("transformers")
    from transformers import GPT2Tokenizer

    _tiny_bytelevel_bpe(tmp_path)
    hf = tmp_path / "hf"
    GPT2Tokenizer(str(tmp_path / "vocab.json"), str(tmp_path / "merges.txt"),
                  eos_token="<|endoftext|>").save_pretrained(hf)
    # Old-style directory: vocab.json + merges.txt + tokenizer_config.json only.
    (hf / "tokenizer.json").unlink(missing_ok=True)
    for name in ("vocab.json", "merges.txt"):
        (hf / name).write_bytes((tmp_path / name).read_bytes())
    tok = HuggingFaceTokenizer(tmp_path / "hf")
    vocab = json.loads((tmp_path / "vocab.json").read_text())
    assert tok.eod == vocab["<|endoftext|>"]
    for text in HARD_TEXTS[:5]:
        assert tok.detokenize(tok.tokenize(text)) == text


def test_null_tokenizer():
    tok = build_tokenizer("NullTokenizer", vocab_size=100)
    assert tok.tokenize(" 3  1\n4 ") == [3, 1, 4]
    assert tok.detokenize([3, 1, 4]) == "3 1 4"
    assert tok.eod == 100 and tok.vocab_size == 101
    with pytest.raises(ValueError, match="--vocab-size"):
        tok.tokenize("100")
    with pytest.raises(ValueError, match="integers"):
        tok.tokenize("three")


@pytest.mark.parametrize("kind, kwargs, flag", [
    ("SentencePieceTokenizer", {}, "--tokenizer-model"),
    ("SentencePieceTokenizer", {"tokenizer_model": "/nonexistent/x.model"}, "--tokenizer-model"),
    ("GPT2BPETokenizer", {"merge_file": "m.txt"}, "--vocab-file"),
    ("GPT2BPETokenizer", {"vocab_file": __file__, "merge_file": "/nonexistent"}, "--merge-file"),
    ("HuggingFaceTokenizer", {"tokenizer_model": "/nonexistent/dir"}, "--tokenizer-model"),
    ("NullTokenizer", {}, "--vocab-size"),
    ("BertTokenizer", {}, "--tokenizer-type"),
])
def test_build_tokenizer_errors_name_the_flag(kind, kwargs, flag):
    with pytest.raises((ValueError, FileNotFoundError), match=flag):
        build_tokenizer(kind, **kwargs)
