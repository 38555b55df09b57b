#!/usr/bin/env python
"""Will this GPT training plan fit on the device? Per-rank memory by kind.

    python tools/estimate_memory.py --world-size 64 --model-preset gpt-13b --tp 4 --zero-stage 3 --bf16
    python tools/estimate_memory.py --world-size 16 --device-memory-gb 80 PRETRAIN_GPT_FLAGS

The program is megazero.cli.estimate_memory (installed: ``megazero-estimate-memory``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.estimate_memory import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
