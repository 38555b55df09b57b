"""tools/preprocess_data.py: text -> .bin/.idx -> text, parallel determinism, input
forms, and every kind of bad input reported by file and line."""

from __future__ import annotations

import gzip
import os

import numpy as np
import pytest

from megazero.data.indexed_dataset import IndexedDataset
from megazero.data.tokenizer import SentencePieceTokenizer
from tests.data.conftest import SAMPLE_TEXTS, write_jsonl
from tools.preprocess_data import main

NULL = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000", "--no-progress"]


def run(args, capsys):
    code = main([str(a) for a in args])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_round_trip_sentencepiece(tmp_path, spm_model, capsys):
    texts = SAMPLE_TEXTS[:6] + ["  spaces  and\ttabs\n\nemoji 😀", "", "last"]
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in texts])
    code, out, _ = run(["--input", src, "--output-prefix", tmp_path / "o", "--tokenizer-type",
                        "SentencePieceTokenizer", "--tokenizer-model", spm_model, "--append-eod",
                        "--no-progress"], capsys)
    assert code == 0 and "documents: 9" in out and "MB/s" in out
    tok = SentencePieceTokenizer(spm_model)
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert ds.dtype == np.uint16 and len(ds) == len(texts)
    assert ds.doc_idx.tolist() == list(range(len(texts) + 1))
    for i, text in enumerate(texts):
        ids = ds[i].tolist()
        assert ids[-1] == tok.eod
        assert tok.detokenize(ids[:-1]) == text
    assert ds[7].tolist() == [tok.eod]  # empty text + --append-eod: only the EOD


def test_empty_document_without_eod_is_zero_length(tmp_path, null_jsonl, capsys):
    src, docs = null_jsonl
    assert run(["--input", src, "--output-prefix", tmp_path / "o"] + NULL, capsys)[0] == 0
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds.sizes.tolist() == [3, 2, 0, 4, 1]


def test_vocab_size_picks_dtype(tmp_path, null_jsonl, capsys):
    src, docs = null_jsonl
    run(["--input", src, "--output-prefix", tmp_path / "big", "--tokenizer-type", "NullTokenizer",
         "--vocab-size", "70000", "--no-progress"], capsys)
    assert IndexedDataset(tmp_path / "big_text_document").dtype == np.int32
    assert IndexedDataset(tmp_path / "big_text_document")[0].tolist() == docs[0]
    with open(tmp_path / "big_text_document.idx", "rb") as f:
        assert f.read(18)[17] == 4  # Megatron dtype code of int32


def test_workers_give_byte_identical_files(tmp_path, spm_model, capsys):
    rows = [{"text": SAMPLE_TEXTS[i % len(SAMPLE_TEXTS)] * (1 + i % 3)} for i in range(300)]
    rows[7]["text"] = ""
    src = write_jsonl(tmp_path / "in.jsonl", rows)
    common = ["--input", src, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
              spm_model, "--append-eod", "--no-progress", "--chunksize", "8"]
    assert run(common + ["--workers", "1", "--output-prefix", tmp_path / "w1"], capsys)[0] == 0
    assert run(common + ["--workers", "2", "--output-prefix", tmp_path / "w2"], capsys)[0] == 0
    for ext in (".bin", ".idx"):
        a = (tmp_path / f"w1_text_document{ext}").read_bytes()
        assert a == (tmp_path / f"w2_text_document{ext}").read_bytes()
    assert len(IndexedDataset(tmp_path / "w2_text_document")) == 300


def test_input_forms_and_multiple_keys(tmp_path, capsys):
    d = tmp_path / "shards"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"text": "1 2", "title": "3"}])
    with gzip.open(d / "b.jsonl.gz", "wb") as f:
        f.write(b'{"text": "4", "title": "5 6"}\n\n   \n')  # blank lines are skipped
    (d / "notes.txt").write_text("ignored")
    for inputs in ([d], [d / "a.jsonl", d / "b.jsonl.gz"], [str(d / "*.jsonl*")]):
        code, out, _ = run(["--input", *inputs, "--output-prefix", tmp_path / "o",
                            "--json-keys", "text", "title"] + NULL, capsys)
        assert code == 0
        text, title = IndexedDataset(tmp_path / "o_text_document"), IndexedDataset(tmp_path / "o_title_document")
        assert [text[i].tolist() for i in range(2)] == [[1, 2], [4]]
        assert [title[i].tolist() for i in range(2)] == [[3], [5, 6]]
    assert "blank lines skipped: 2" in out


BAD_LINES = [
    (b'{"text": "1 2"\n', "invalid JSON"),
    (b'{"body": "1 2", "id": 3}\n', "missing key 'text'; the line has keys ['body', 'id']: choose one with --json-keys"),
    (b'{"text": 12}\n', "key 'text' holds a int, expected a string"),
    (b'{"text": "1 \xff 2"}\n', "invalid UTF-8 at byte offset 12"),
    (b'["text"]\n', "expected a JSON object"),
    (b'{"text": "1 two"}\n', "NullTokenizer expects space-separated integers"),
]


@pytest.mark.parametrize("raw, reason", BAD_LINES)
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_line_is_reported_and_nothing_written(tmp_path, raw, reason, workers, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}, {"text": "2"}], raw_lines=[raw, b'{"text": "3"}\n'])
    code, _, err = run(["--input", src, "--output-prefix", tmp_path / "o", "--workers", workers] + NULL, capsys)
    assert code == 1
    assert f"{src}:3: {reason}" in err
    assert "--skip-bad-lines" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]  # no .bin/.idx, no temporary files


def test_skip_bad_lines_counts_them(tmp_path, capsys):
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": "1"}],
                      raw_lines=[raw for raw, _ in BAD_LINES] + [b'{"text": "2 3"}\n'])
    code, out, _ = run(["--input", src, "--output-prefix", tmp_path / "o", "--skip-bad-lines"] + NULL, capsys)
    assert code == 0
    assert f"bad lines skipped: {len(BAD_LINES)}" in out and f"{src}:2: invalid JSON" in out
    ds = IndexedDataset(tmp_path / "o_text_document")
    assert [ds[i].tolist() for i in range(len(ds))] == [[1], [2, 3]]


@pytest.mark.parametrize("workers", [1, 2])
def test_truncated_gzip_is_reported(tmp_path, workers, capsys):
    data = gzip.compress(b"".join(b'{"text": "%d %d"}\n' % (i % 7, i % 5) for i in range(20000)))
    (tmp_path / "cut.jsonl.gz").write_bytes(data[: len(data) // 2])
    code, _, err = run(["--input", tmp_path / "cut.jsonl.gz", "--output-prefix", tmp_path / "o",
                        "--workers", workers] + NULL, capsys)
    assert code == 1 and "cut.jsonl.gz: cannot read after line" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["cut.jsonl.gz"]


def test_failed_rerun_keeps_previous_complete_output(tmp_path, capsys):
    good = write_jsonl(tmp_path / "good.jsonl", [{"text": "1 2"}])
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"text": "5"}] * 50, raw_lines=[b"oops\n"])
    assert run(["--input", good, "--output-prefix", tmp_path / "o"] + NULL, capsys)[0] == 0
    before = (tmp_path / "o_text_document.bin").read_bytes()
    assert run(["--input", bad, "--output-prefix", tmp_path / "o"] + NULL, capsys)[0] == 1
    assert (tmp_path / "o_text_document.bin").read_bytes() == before
    assert IndexedDataset(tmp_path / "o_text_document")[0].tolist() == [1, 2]
    assert not [p for p in os.listdir(tmp_path) if ".tmp" in p]


@pytest.mark.parametrize("args, message", [
    (["--input", "/nonexistent.jsonl"] + NULL, "does not exist"),
    (["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "/no/such.model"], "--tokenizer-model"),
    (["--tokenizer-type", "NullTokenizer"], "--vocab-size"),
])
def test_flag_errors(tmp_path, null_jsonl, args, message, capsys):
    src, _ = null_jsonl
    full = ["--input", src, "--output-prefix", tmp_path / "o"]
    code, _, err = run(full + args, capsys)
    assert code == 1 and message in err


def test_streaming_pool_reads_ahead_only_a_bounded_window(tmp_path, monkeypatch):
    """With workers, the reader must not run far ahead of the writer (flat memory)."""
    from megazero.data import preprocess as pp

    n_lines, chunksize, workers = 3000, 4, 2
    src = write_jsonl(tmp_path / "in.jsonl", [{"text": str(i % 900)} for i in range(n_lines)])
    read, written, max_ahead = [0], [0], [0]
    real_iter = pp.iter_raw_lines

    def counting_reader(files):
        for item in real_iter(files):
            read[0] += 1
            yield item

    class CountingWriter(pp.AtomicDatasetWriter):
        def __init__(self, *args):
            super().__init__(*args)
            add = self.builder.add_item

            def add_item(tokens):
                written[0] += 1
                max_ahead[0] = max(max_ahead[0], read[0] - written[0])
                add(tokens)

            self.builder.add_item = add_item

    monkeypatch.setattr(pp, "iter_raw_lines", counting_reader)
    monkeypatch.setattr(pp, "AtomicDatasetWriter", CountingWriter)
    stats = pp.preprocess(pp.PreprocessConfig(
        inputs=[str(src)], output_prefix=str(tmp_path / "o"), tokenizer_type="NullTokenizer",
        vocab_size=1000, workers=workers, chunksize=chunksize, progress=False))
    assert stats.documents == written[0] == n_lines
    assert max_ahead[0] <= chunksize * workers * 4 + chunksize, max_ahead[0]
