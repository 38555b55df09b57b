"""Recurrent token mixers in pure PyTorch: the chunked Mamba-2 state space duality scan with its step-by-step
reference and the transition that passes its state between sequence pieces (ssd.py), and the gated RMSNorms that
Mamba-2 / Nemotron-H and Gated DeltaNet / Qwen3-Next put after their mixers (gated_norm.py)."""
