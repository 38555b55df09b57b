#!/usr/bin/env python
"""Concatenate Megatron .bin/.idx datasets into one, in the order given.

    python tools/merge_datasets.py --input data/a_text_document data/b_text_document --output-prefix data/ab

The program is megazero.cli.merge_datasets (installed: ``megazero-merge-datasets``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.merge_datasets import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
