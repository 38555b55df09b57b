#!/usr/bin/env python
"""Write the embedded default corpus (Shakespeare's plays, one JSON line per scene).

    python tools/build_corpus.py --output data/shakespeare.jsonl
    python tools/build_corpus.py --prepare data/     # also tokenizer + .bin/.idx

The program is megazero.cli.build_corpus (installed: ``megazero-build-corpus``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.build_corpus import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
