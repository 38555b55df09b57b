"""Named scopes: the mechanism says what it is doing, observers read it.

``with scope("zero.reduce"):`` marks a region of work (ZeRO's gradient buckets, its optimizer
step, a gather). Two readers see it: :func:`current_scopes` (a memory tracker labelling the
allocations made inside, ``megazero/observe``) and torch's profiler, which shows each scope as
``megazero::<name>`` (as FSDP2's ``record_function("FSDP::all_gather")``). The stack is a context
variable, so threads (an offload's I/O workers) and nested scopes each see their own.

Names in use (``<layer>.<what>``): ``zero.gather`` (ZeRO-3 all-gathers), ``zero.reduce``
(gradient buckets being reduce-scattered), ``zero.step`` (the optimizer step: norms, update,
publishing the new weights), ``train.norms`` (the training loop's parameter and gradient
statistics). Nothing here allocates on the device or synchronises.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

__all__ = ["scope", "current_scopes", "innermost_scope"]

_STACK: contextvars.ContextVar[tuple[str, ...]] = contextvars.ContextVar("megazero_scopes", default=())


class scope(contextlib.ContextDecorator):
    """``with scope(name):`` (or ``@scope(name)``) runs the body inside scope ``name``; nested scopes stack.

    torch's profiler is told only while it records: ``record_function`` costs microseconds per
    entry even when nothing reads it, and ZeRO enters a scope per gather and per bucket."""

    __slots__ = ("name", "_token", "_record")

    def __init__(self, name: str) -> None:
        self.name = name

    def _recreate_cm(self) -> "scope":  # a decorated function enters a fresh scope per call
        return scope(self.name)

    def __enter__(self) -> None:
        self._token = _STACK.set(_STACK.get() + (self.name,))
        self._record = None
        if torch.autograd._profiler_enabled():
            self._record = torch.profiler.record_function(f"megazero::{self.name}")
            self._record.__enter__()

    def __exit__(self, *exc) -> None:
        try:
            if self._record is not None:
                self._record.__exit__(*exc)
        finally:
            _STACK.reset(self._token)


def current_scopes() -> tuple[str, ...]:
    """The scopes entered and not yet left in this context, outermost first."""
    return _STACK.get()


def innermost_scope() -> str:
    """The innermost scope's name, or '' outside every scope."""
    stack = _STACK.get()
    return stack[-1] if stack else ""
