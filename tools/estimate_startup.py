#!/usr/bin/env python
"""Time to resume or initialize a run, per rank, from the layout.

    python tools/estimate_startup.py --world-size 64 PRETRAIN_GPT_FLAGS

The program is megazero.cli.estimate_startup (installed: ``megazero-estimate-startup``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.estimate_startup import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
