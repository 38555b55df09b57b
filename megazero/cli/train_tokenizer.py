"""Train a lossless SentencePiece tokenizer on the texts of JSONL files.

    python tools/train_tokenizer.py --input data/shakespeare.jsonl --json-keys text \\
        --vocab-size 4096 --output-prefix data/spm_4096      # writes data/spm_4096.model

Installed: ``megazero-train-tokenizer``. Settings round-trip text exactly (identity
normalization, whitespace kept, newline as a symbol, byte fallback); long lines are cut
below SentencePiece's 4 KB limit. Use the result with ``--tokenizer-type
SentencePieceTokenizer --tokenizer-model P.model``.
"""

from __future__ import annotations

import argparse
import logging
import time
from typing import Iterator, Sequence, Union

from megazero.cli.common import setup_logging, tool_parser, write_output
from megazero.data.preprocess import BadLineError, PreprocessError, iter_raw_lines, parse_line, resolve_inputs
from megazero.data.tokenizer import SentencePieceTokenizer
from megazero.data.tokenizer_training import train_sentencepiece

__all__ = ["build_parser", "main", "train_sentencepiece", "iter_jsonl_texts"]

log = logging.getLogger(__name__)


def iter_jsonl_texts(inputs: list[str], keys: Union[str, Sequence[str]],
                     skip_bad_lines: bool = False) -> Iterator[str]:
    """Texts under ``keys`` (one key or several, in order) of every line of the inputs (files, globs,
    directories)."""
    keys = [keys] if isinstance(keys, str) else list(keys)
    for path, lineno, raw in iter_raw_lines(resolve_inputs(inputs)):
        try:
            parsed = parse_line(raw, keys)
        except ValueError as e:
            if skip_bad_lines:
                continue
            raise BadLineError(path, lineno, str(e)) from None
        if parsed is not None:
            yield from (parsed[k] for k in keys)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    p.add_argument("--input", nargs="+", required=True, help="JSONL files (.jsonl[.gz]), globs or directories")
    p.add_argument("--json-keys", "--json-key", dest="json_keys", nargs="+", default=["text"],
                   help="keys holding the text (each line's texts under every key are trained on)")
    p.add_argument("--vocab-size", type=int, required=True)
    p.add_argument("--output-prefix", required=True, help="writes <prefix>.model and <prefix>.vocab")
    p.add_argument("--model-type", default="unigram", choices=["unigram", "bpe"])
    p.add_argument("--split-digits", action="store_true", help="one token per digit")
    p.add_argument("--skip-bad-lines", action="store_true")
    p.add_argument("--verbose", action="store_true", help="show SentencePiece's training log")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    start = time.perf_counter()
    try:
        model = train_sentencepiece(
            iter_jsonl_texts(args.input, args.json_keys, args.skip_bad_lines), args.output_prefix,
            args.vocab_size, model_type=args.model_type, split_digits=args.split_digits,
            verbose=args.verbose)
    except (PreprocessError, ValueError) as e:
        log.error("error: %s", e)
        return 1
    except RuntimeError as e:  # SentencePiece reports bad settings / empty input this way
        log.error("error: SentencePiece training failed: %s", e)
        return 1
    tok = SentencePieceTokenizer(model)
    write_output(f"wrote {model}: vocab {tok.vocab_size}, eod id {tok.eod} "
                 f"({time.perf_counter() - start:.1f} s)")
    return 0
