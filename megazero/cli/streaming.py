"""Progress of the layer-by-layer converters (``megazero.model.state_dict.convert_streaming``)."""

from __future__ import annotations

import logging
from typing import Callable

import torch

from megazero.model.state_dict import layer_of
from megazero.utils.progress import Progress


class LayerProgress:
    """Wraps the ``read`` given to ``convert_streaming``: reads come one layer after the other, so the
    first read of a new layer means the previous one is converted and written.

        with LayerProgress(read, names, log) as reads:
            convert_streaming(..., names, reads, ...)
    """

    def __init__(self, read: Callable[[str], torch.Tensor], names, logger: logging.Logger) -> None:
        self._read = read
        self._current = None
        self.progress = Progress("converted", total=len({layer_of(n) for n in names} - {-1}), unit="layers",
                                 logger=logger)

    def __call__(self, name: str) -> torch.Tensor:
        layer = layer_of(name)
        if layer != self._current:
            self._finish()
            self._current = layer
        return self._read(name)

    def _finish(self) -> None:
        if self._current is not None and self._current >= 0:
            self.progress.update()

    def __enter__(self) -> "LayerProgress":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._finish()
            self._current = None
        self.progress.close(completed=exc_type is None)
