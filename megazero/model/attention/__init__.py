"""Attention: the core kernels, the attention layers, RoPE, and their context-parallel exchanges."""
