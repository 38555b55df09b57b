#!/usr/bin/env python
"""Time tools/preprocess_data on the default corpus with 1 and 2 workers.

    python benchmarks/bench_preprocess.py [--workdir DIR] [--repeat 8] [--workers 1 2]

Builds (or reuses) the Shakespeare JSONL and its SentencePiece model in the work dir,
repeats the JSONL ``--repeat`` times so that pool start-up is amortized, then
preprocesses it once per worker count and prints MB/s, docs/s, tokens/s and the
speed-up over 1 worker. Outputs of the runs are checked to be byte-identical.
"""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.data.corpus import DEFAULT_VOCAB_SIZE, _jsonl_texts, write_shakespeare_jsonl  # noqa: E402
from megazero.data.preprocess import PreprocessConfig, preprocess  # noqa: E402
from megazero.data.tokenizer_training import train_sentencepiece  # noqa: E402


def run(workdir: Path, repeat: int, workers: list[int], vocab_size: int) -> list[dict]:
    workdir.mkdir(parents=True, exist_ok=True)
    corpus = workdir / "shakespeare.jsonl"
    if not corpus.exists():
        write_shakespeare_jsonl(corpus)
    model = workdir / f"spm_{vocab_size}.model"
    if not model.exists():
        train_sentencepiece(_jsonl_texts(corpus), str(model)[:-6], vocab_size)
    bench_input = workdir / f"bench_x{repeat}.jsonl"
    if not bench_input.exists():
        data = corpus.read_bytes()
        with open(bench_input, "wb") as f:
            for _ in range(repeat):
                f.write(data)

    rows = []
    for w in workers:
        stats = preprocess(PreprocessConfig(
            inputs=[str(bench_input)], output_prefix=str(workdir / f"bench_w{w}"),
            tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(model),
            append_eod=True, workers=w, progress=False))
        secs = stats.seconds
        ntok = sum(stats.tokens.values())
        rows.append({"workers": w, "seconds": secs, "mb_s": stats.input_bytes / 1e6 / secs,
                     "docs_s": stats.documents / secs, "tokens_s": ntok / secs,
                     "documents": stats.documents, "tokens": ntok, "mb": stats.input_bytes / 1e6,
                     "prefix": stats.outputs["text"]})
    for r in rows[1:]:
        for ext in (".bin", ".idx"):
            if not filecmp.cmp(rows[0]["prefix"] + ext, r["prefix"] + ext, shallow=False):
                raise SystemExit(f"outputs differ between {rows[0]['workers']} and {r['workers']} workers")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", help="reuse/keep files here (default: a temporary directory)")
    p.add_argument("--repeat", type=int, default=8, help="copies of the corpus in the input (default 8)")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        rows = run(Path(args.workdir or tmp), args.repeat, args.workers, args.vocab_size)
    r0 = rows[0]
    print(f"input: {r0['mb']:.1f} MB, {r0['documents']:,} docs, {r0['tokens']:,} tokens "
          f"(Shakespeare x{args.repeat}, SentencePiece vocab {args.vocab_size})")
    print(f"{'workers':>7} {'seconds':>8} {'MB/s':>8} {'docs/s':>9} {'tokens/s':>12} {'speed-up':>8}")
    for r in rows:
        print(f"{r['workers']:>7} {r['seconds']:>8.2f} {r['mb_s']:>8.2f} {r['docs_s']:>9,.0f} "
              f"{r['tokens_s']:>12,.0f} {r0['seconds'] / r['seconds']:>7.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
