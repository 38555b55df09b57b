#!/usr/bin/env python
"""Train a lossless SentencePiece tokenizer on the texts of JSONL files.

    python tools/train_tokenizer.py --input data/shakespeare.jsonl --json-keys text \\
        --vocab-size 4096 --output-prefix data/spm_4096

The program is megazero.cli.train_tokenizer (installed: ``megazero-train-tokenizer``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.train_tokenizer import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
