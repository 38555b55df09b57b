"""Token mixers that carry a state along the sequence: Gated DeltaNet and Mamba-2 (``mamba.py``), their chunked
kernels (the Mamba-2 state space duality scan with its step-by-step reference and the transition that passes its
state between sequence pieces, ``ssd.py``; the gated RMSNorms after the mixers, ``gated_norm.py``), and the driver
that runs them over packed documents and context-parallel shards (``sequence.py``)."""
