#!/usr/bin/env python
"""Rehearse ranks of a pretrain_gpt.py launch on this host: memory and traffic per rank, no GPU.

    python tools/rehearse.py --world-size 64 [--ranks 0,13] [--device-memory-gb 80] -- PRETRAIN_GPT_FLAGS

The program is megazero.cli.rehearse (installed: ``megazero-rehearse``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.rehearse import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
