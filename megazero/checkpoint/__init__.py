"""Checkpoint formats: what a run saves, what it resumes from, and what the programs read.

* ``formats``: the protocol the loop's checkpointer uses (``holds``, ``stage``, ``load``) and the registered
  formats, megazero's own (``native``) and Megatron-LM's ``torch_dist`` (``torch_dist_save`` writes it,
  ``megatron_resume`` reads megazero's and Megatron-LM's at any layout, ``torch_dist_buckets`` the
  ``dp_reshardable`` optimizer state);
* ``async_save``: a save staged on the main thread, written in the foreground or a background thread,
  committed by every rank together;
* ``reader``: the one loader of every program that reads a checkpoint's model (generate, converters);
* ``torch_dist`` and ``torch_dist_source``: the DCP reader and megazero's names over it; ``megatron_legacy`` and
  ``megatron_pickle``: Megatron-LM's and Megatron-DeepSpeed's ``.pt`` files, read without running their code.

The engine's partitions are read and written through ZeRO's API (:mod:`megazero.zero.checkpoint`); nothing
here imports the configuration or the loop.
"""
