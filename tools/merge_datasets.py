#!/usr/bin/env python
"""Concatenate Megatron .bin/.idx datasets into one, in the order given.

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \\
        --output-prefix data/ab_text_document
    python tools/merge_datasets.py --input data/shards/ --output-prefix data/all_text_document

A directory input means every ``*.idx``/``*.bin`` pair in it, sorted by name.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megazero.data.indexed_dataset import (  # noqa: E402
    AtomicDatasetWriter, IndexedDataset, IndexedDatasetError, dataset_exists,
)


def resolve_prefixes(inputs: list[str]) -> list[str]:
    """Dataset prefixes from prefixes and directories; raises ValueError naming what is missing."""
    prefixes: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(str(p)[:-4] for p in Path(item).glob("*.idx") if dataset_exists(str(p)[:-4]))
            if not found:
                raise ValueError(f"directory '{item}' holds no .bin/.idx dataset pairs")
            prefixes += found
        else:
            if item.endswith((".bin", ".idx")):
                item = item[:-4]
            if not dataset_exists(item):
                raise ValueError(f"'{item}.bin'/'{item}.idx' not found; --input takes dataset prefixes "
                                 f"(path without .bin/.idx) or directories")
            prefixes.append(item)
    return prefixes


def merge_datasets(prefixes: list[str], output_prefix: str) -> IndexedDataset:
    """Write the concatenation of ``prefixes`` to ``output_prefix`` atomically; return it."""
    if not prefixes:
        raise ValueError("nothing to merge")
    out = os.path.abspath(output_prefix)
    if any(os.path.abspath(p) == out for p in prefixes):
        raise ValueError(f"--output-prefix {output_prefix} is also an input")
    dtype = IndexedDataset(prefixes[0]).dtype
    with AtomicDatasetWriter(output_prefix, dtype) as writer:
        for prefix in prefixes:
            writer.builder.add_index(prefix)
        writer.commit()
    return IndexedDataset(output_prefix)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes or directories")
    p.add_argument("--output-prefix", required=True, help="writes <output-prefix>.bin/.idx")
    args = p.parse_args(argv)
    try:
        prefixes = resolve_prefixes(args.input)
        merged = merge_datasets(prefixes, args.output_prefix)
    except (ValueError, OSError) as e:  # IndexedDatasetError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"merged {len(prefixes)} datasets -> {args.output_prefix}.bin/.idx: "
          f"{len(merged.doc_idx) - 1:,} documents, {merged.num_tokens:,} tokens ({merged.dtype})")
    return 0


__all__ = ["main", "merge_datasets", "resolve_prefixes", "IndexedDatasetError"]

if __name__ == "__main__":
    sys.exit(main())
