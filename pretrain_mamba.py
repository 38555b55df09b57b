"""pretrain_hybrid.py under Megatron-LM's older name: the program of pretrain_gpt.py, so Megatron's Mamba launch
lines (--spec megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec) run unchanged.

    torchrun --nproc_per_node 8 pretrain_mamba.py --hybrid-layer-pattern "M-M-M*-M-M-" --hidden-size 1024 ...
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from a checkout without installing

from megazero.cli.pretrain_gpt import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
