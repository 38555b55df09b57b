"""Pre-train a hybrid model (Mamba-2, Gated DeltaNet, attention and MLP layers by --hybrid-layer-pattern) under
Megatron-LM's name for it: the program of pretrain_gpt.py, so Megatron's hybrid launch lines run unchanged.

    torchrun --nproc_per_node 8 pretrain_hybrid.py --hybrid-layer-pattern "M-M-M*-M-M-" --hidden-size 1024 ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from a checkout without installing

from megazero.cli.pretrain_gpt import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
