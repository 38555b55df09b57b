"""Resolving a parsed Megatron-style command line into the typed ``TrainConfig``, one concern a file.

``megazero.config.arguments.parse_args`` builds the ``argparse.Namespace`` from the flag table
and calls, in order:

- ``deepspeed_json``: the --deepspeed-config JSON merged into the namespace (and refused where it disagrees)
- ``parallel``: tp x pp x dp, ZeRO stage, sequence parallel; the pipeline's virtual stages and layer split
- ``precision``: bf16 / fp16 / fp32 and the fp16 loss scaler
- ``optim``: optimizer type, lr, betas, weight decay (and its schedule), clipping
- ``data``: data paths, split, tokenizer and its files
- ``hybrid``: the layers by kind (--hybrid-layer-pattern, Gated DeltaNet and Mamba-2 flags), which give --num-layers
- ``model``: GPTConfig from the model flags, --model-preset and the checkpoint (see ``resume``)
- ``schedule``: micro/global batch, ramp-up, iterations or samples, LR schedule, evaluation and exit
- ``resume``: checkpoint flags, and what an earlier run saved (--use-checkpoint-args, vocabulary padding)
- ``logs``: log interval, metrics file, TensorBoard, CSV, Weights & Biases

Each raises ``ConfigError`` naming the flags and numbers at fault. ``common`` holds the small helpers.
"""
