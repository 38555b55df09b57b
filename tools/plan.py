#!/usr/bin/env python
"""Which layout? The fastest tp/pp/vpp/cp/ep/ZeRO/SP/recompute/micro-batch that fits, explained.

    python tools/plan.py --world-size 64 --gpu h100-80gb --model-preset gpt-13b --global-batch-size 1024 --bf16

The program is megazero.cli.plan (installed: ``megazero-plan``); ``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.plan import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
