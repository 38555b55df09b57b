#!/usr/bin/env python
"""Import a Megatron-LM or Megatron-DeepSpeed GPT checkpoint as a full megazero checkpoint.

    python tools/convert_from_megatron.py --input /ckpt/gpt-1.3b --output ckpt/gpt-1.3b-mz \\
        [--vocab-size 50257]

The program is megazero.cli.convert_from_megatron (installed: ``megazero-convert-from-megatron``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.convert_from_megatron import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
