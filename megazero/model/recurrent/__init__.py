"""Recurrent sequence mixers (linear-attention and state-space layers): a state of fixed size carried along the
sequence in place of attention's growing key/value cache, computed chunk by chunk for training and step by step
for decoding, with packed documents resetting the state where a new one begins."""
