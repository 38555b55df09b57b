"""Token mixers that carry a state along the sequence: Gated DeltaNet, Kimi Delta Attention and Mamba-2, their
chunked kernels, and the driver that runs them over packed documents and context-parallel shards (``sequence.py``)."""
