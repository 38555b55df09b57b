#!/usr/bin/env python
"""Import a local Hugging Face GPT-2 or Llama checkpoint as a full megazero checkpoint.

    python tools/convert_from_hf.py --input hf/gpt2 --output ckpt/gpt2 [--override FIELD=VALUE ...]

The program is megazero.cli.convert_from_hf (installed: ``megazero-convert-from-hf``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.convert_from_hf import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
