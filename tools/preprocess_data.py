#!/usr/bin/env python
"""Tokenize JSONL into Megatron-LM <output-prefix>_<key>_document.bin/.idx files.

    python tools/preprocess_data.py --input data/shakespeare.jsonl --json-keys text \\
        --output-prefix data/shakespeare --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model data/spm_4096.model --append-eod --workers 2

The program is megazero.cli.preprocess_data (installed: ``megazero-preprocess-data``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.preprocess_data import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
