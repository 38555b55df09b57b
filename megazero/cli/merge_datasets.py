"""Concatenate Megatron .bin/.idx datasets into one, in the order given.

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document \\
        --output-prefix data/ab_text_document
    python tools/merge_datasets.py --input data/shards/ --output-prefix data/all_text_document

Installed: ``megazero-merge-datasets``. A directory input means every ``*.idx``/``*.bin``
pair in it, sorted by name.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from megazero.cli.common import setup_logging, tool_parser, write_output
from megazero.data.indexed_dataset import AtomicDatasetWriter, IndexedDataset, IndexedDatasetError, dataset_exists
from megazero.utils.progress import Progress

__all__ = ["build_parser", "main", "merge_datasets", "resolve_prefixes", "IndexedDatasetError"]

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = tool_parser(__doc__)
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes or directories")
    p.add_argument("--output-prefix", required=True, help="writes <output-prefix>.bin/.idx")
    return p


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
        with Progress("merged", total=len(prefixes), unit="datasets", logger=log) as progress:
            for prefix in prefixes:
                writer.builder.add_index(prefix)
                progress.update()
        writer.commit()
    return IndexedDataset(output_prefix)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    setup_logging()
    try:
        prefixes = resolve_prefixes(args.input)
        merged = merge_datasets(prefixes, args.output_prefix)
    except (ValueError, OSError) as e:  # IndexedDatasetError is a ValueError
        log.error("error: %s", e)
        return 1
    write_output(f"merged {len(prefixes)} datasets -> {args.output_prefix}.bin/.idx: "
                 f"{len(merged.doc_idx) - 1:,} documents, {merged.num_tokens:,} tokens ({merged.dtype})")
    return 0
