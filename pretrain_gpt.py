"""Pre-train a GPT with tensor parallelism and ZeRO (Megatron-LM's flags).

    torchrun --nproc_per_node 4 pretrain_gpt.py --tp 2 --zero-stage 3 \\
        --model-preset gpt-tiny --data-path PREFIX --tokenizer-type SentencePieceTokenizer \\
        --tokenizer-model tok.model --micro-batch-size 4 --global-batch-size 32 --train-iters 100 \\
        --lr 1e-3 --save ckpt --save-interval 50 --load ckpt

    python pretrain_gpt.py --help      # every flag; refused and mapped ones: docs/flags.md

The program is megazero.cli.pretrain_gpt (installed: ``megazero-pretrain-gpt``).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run from a checkout without installing

from megazero.cli.pretrain_gpt import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
