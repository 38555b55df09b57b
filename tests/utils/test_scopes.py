"""Named scopes: the stack every reader sees, and torch's profiler told only while it records."""

from __future__ import annotations

import threading

import torch

from megazero.utils.scopes import current_scopes, innermost_scope, scope


def test_scopes_stack_and_unwind_on_error():
    with scope("zero.step"):
        with scope("zero.gather"):
            assert current_scopes() == ("zero.step", "zero.gather") and innermost_scope() == "zero.gather"
        try:
            with scope("zero.reduce"):
                raise RuntimeError("inside")
        except RuntimeError:
            pass
        assert current_scopes() == ("zero.step",)
    assert current_scopes() == () and innermost_scope() == ""


def test_a_decorated_function_enters_a_fresh_scope_per_call_and_per_thread():
    @scope("train.norms")
    def inner(depth: int) -> tuple[str, ...]:
        return current_scopes() if depth == 0 else inner(depth - 1)

    assert inner(2) == ("train.norms",) * 3 and current_scopes() == ()
    seen = []
    threads = [threading.Thread(target=lambda: seen.append(inner(1))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seen == [("train.norms",) * 2] * 4


def test_the_profiler_sees_scopes_only_while_it_records():
    with scope("zero.gather"):  # no profiler: nothing recorded, the stack as always
        assert current_scopes() == ("zero.gather",)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with scope("zero.gather"):
            torch.ones(2).add_(1)
    assert [e.name for e in prof.events() if e.name.startswith("megazero::")] == ["megazero::zero.gather"]
