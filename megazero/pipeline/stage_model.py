"""What the pipeline needs of a model chunk: :class:`StageModel`.

A schedule runs chunks, not a particular model. Each chunk says what crosses a stage boundary (the
activation's shape and dtype, which the p2p transfers allocate up front), which of its weights it
shares with the other end of the pipeline (completed over the embedding group after each step), how a
micro-batch becomes its forward's arguments, and takes the previous stage's activation before a
forward. ``megazero.model``'s ``GPTModel`` implements it.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

__all__ = ["StageModel"]


class StageModel(Protocol):
    """A model chunk as a pipeline stage runs it (structural: a model implements it without importing it)."""

    def stage_activation(self, micro_batch_size: int, seq_length: int, groups,
                         compute_dtype: Optional[torch.dtype] = None) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of the activation sent between stages for a micro-batch of ``micro_batch_size``
        sequences of ``seq_length`` tokens under ``groups``; ``compute_dtype``: the engine's, if it has one."""
        ...

    def shared_embedding(self) -> Optional[torch.nn.Parameter]:
        """The weight this chunk shares with the other end of the pipeline (first and last stage, the
        embedding group), whose gradient is completed over that group; None when it shares none."""
        ...

    def stage_inputs(self, micro_batch: Any, *, first: bool, last: bool) -> tuple[tuple, dict[str, Any]]:
        """``(args, kwargs)`` of the chunk's forward for ``micro_batch`` on the ``first`` virtual stage (which
        takes no activation) and / or the ``last`` (which returns the per-token loss)."""
        ...

    def set_input_tensor(self, input_tensor: Optional[torch.Tensor]) -> None:
        """The previous stage's activation, for the next forward (not called on the first stage)."""
        ...
