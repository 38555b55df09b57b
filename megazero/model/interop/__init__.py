"""Weights in and out: Hugging Face models and Megatron-LM checkpoints."""
