#!/usr/bin/env python
"""Export a megazero checkpoint to a Hugging Face transformers directory.

    python tools/convert_to_hf.py --load ckpt --output hf/my-gpt

The program is megazero.cli.convert_to_hf (installed: ``megazero-convert-to-hf``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.convert_to_hf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
