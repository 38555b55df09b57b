"""Tokenize JSONL into Megatron-LM ``<output-prefix>_<key>_document.bin/.idx`` files.

Flags match Megatron-LM's tools/preprocess_data.py. Example::

    python tools/preprocess_data.py --input data/shakespeare.jsonl \\
        --output-prefix data/shakespeare --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model data/spm_4096.model --append-eod --workers 2

Installed: ``megazero-preprocess-data``. One JSON line is one document (one sequence), so
document i of every key's output is accepted line i. An empty text is kept as a
zero-length document (just the EOD token with --append-eod); whitespace-only lines are
skipped and counted. Bad lines stop the run with file:line and reason unless
--skip-bad-lines. Outputs appear only complete: they are written as *.tmp and renamed at
the end (.idx last). Progress goes to stderr (a bar on a terminal, a line every few
seconds otherwise); the summary to stdout.
"""

from __future__ import annotations

import argparse
import logging

from megazero.cli.common import setup_logging, tool_parser, write_output
from megazero.data.preprocess import PreprocessConfig, PreprocessError, preprocess
from megazero.data.tokenizer import TOKENIZER_TYPES

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    g = p.add_argument_group("input")
    g.add_argument("--input", nargs="+", required=True,
                   help="JSONL files (.jsonl or .jsonl.gz), globs, or directories")
    g.add_argument("--json-keys", "--json-key", dest="json_keys", nargs="+", default=["text"], help="keys to extract")
    g.add_argument("--skip-bad-lines", action="store_true",
                   help="skip (and count) malformed lines instead of stopping at the first one")
    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", required=True, choices=TOKENIZER_TYPES)
    g.add_argument("--tokenizer-model", help="SentencePiece .model file, or a Hugging Face tokenizer directory")
    g.add_argument("--vocab-file", help="GPT-2 vocab.json")
    g.add_argument("--merge-file", help="GPT-2 merges.txt")
    g.add_argument("--vocab-size", type=int, help="vocab size for NullTokenizer")
    g.add_argument("--append-eod", action="store_true", help="append the end-of-document token to each document")
    g = p.add_argument_group("output")
    g.add_argument("--output-prefix", required=True, help="writes <prefix>_<key>_document.bin/.idx")
    g = p.add_argument_group("runtime")
    g.add_argument("--workers", type=int, default=1, help="tokenizer processes")
    g.add_argument("--chunksize", type=int, default=64, help="lines per task sent to a worker")
    g.add_argument("--log-interval", type=int, default=1000, help="documents between throughput updates")
    g.add_argument("--no-progress", action="store_true", help="no progress bar or progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    config = PreprocessConfig(
        inputs=args.input, output_prefix=args.output_prefix, json_keys=args.json_keys,
        tokenizer_type=args.tokenizer_type, tokenizer_model=args.tokenizer_model,
        vocab_file=args.vocab_file, merge_file=args.merge_file, vocab_size=args.vocab_size,
        append_eod=args.append_eod, workers=args.workers, chunksize=args.chunksize,
        log_interval=args.log_interval, skip_bad_lines=args.skip_bad_lines,
        progress=not args.no_progress,
    )
    try:
        stats = preprocess(config)
    except (PreprocessError, OSError) as e:  # OSError: e.g. output directory not writable
        log.error("error: %s", e)
        return 1
    except KeyboardInterrupt:
        log.error("interrupted: no output written")
        return 130
    write_output(stats.summary())
    return 0

