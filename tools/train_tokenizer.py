#!/usr/bin/env python
"""Train a lossless SentencePiece tokenizer on the texts of JSONL files.

    python tools/train_tokenizer.py --input data/shakespeare.jsonl --json-key text \\
        --vocab-size 4096 --output-prefix data/spm_4096      # writes data/spm_4096.model

Settings round-trip text exactly (identity normalization, whitespace kept, newline
as a symbol, byte fallback); long lines are cut below SentencePiece's 4 KB limit.
Use the result with ``--tokenizer-type SentencePieceTokenizer --tokenizer-model P.model``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Iterator

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.data.preprocess import (  # noqa: E402
    BadLineError, PreprocessError, iter_raw_lines, parse_line, resolve_inputs,
)
from megazero.data.tokenizer import SentencePieceTokenizer  # noqa: E402
from megazero.data.tokenizer_training import train_sentencepiece  # noqa: E402

__all__ = ["main", "train_sentencepiece", "iter_jsonl_texts"]


def iter_jsonl_texts(inputs: list[str], key: str, skip_bad_lines: bool = False) -> Iterator[str]:
    """Texts under ``key`` of every line of the inputs (files, globs, directories)."""
    for path, lineno, raw in iter_raw_lines(resolve_inputs(inputs)):
        try:
            parsed = parse_line(raw, [key])
        except ValueError as e:
            if skip_bad_lines:
                continue
            raise BadLineError(path, lineno, str(e)) from None
        if parsed is not None:
            yield parsed[key]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="JSONL files (.jsonl[.gz]), globs or directories")
    p.add_argument("--json-key", default="text", help="key holding the text (default: text)")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.model and <prefix>.vocab")
    p.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    p.add_argument("--split-digits", action="store_true", help="one token per digit")
    p.add_argument("--skip-bad-lines", action="store_true")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's training log")
    args = p.parse_args(argv)
    start = time.perf_counter()
    try:
        model = train_sentencepiece(
            iter_jsonl_texts(args.input, args.json_key, args.skip_bad_lines), args.output_prefix,
            args.vocab_size, model_type=args.model_type, split_digits=args.split_digits,
            verbose=args.verbose)
    except (PreprocessError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except RuntimeError as e:  # SentencePiece reports bad settings / empty input this way
        print(f"error: SentencePiece training failed: {e}", file=sys.stderr)
        return 1
    tok = SentencePieceTokenizer(model)
    print(f"wrote {model}: vocab {tok.vocab_size}, eod id {tok.eod} "
          f"({time.perf_counter() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
