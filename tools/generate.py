#!/usr/bin/env python
"""Sample text from a megazero checkpoint, at any tensor-parallel size.

    python tools/generate.py --load CKPT_DIR --prompt "ROMEO:" --max-new-tokens 80
    torchrun --nproc_per_node 2 tools/generate.py --load CKPT_DIR --tp 2 --prompt "ROMEO:"

The program is megazero.cli.generate (installed: ``megazero-generate``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.generate import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
