"""Measurement, apart from the mechanism it measures: the memory planner (:mod:`.planner`, the
formulas), the rehearsal (:mod:`.rehearsal`, the real loop on the meta device) and the labels
of a step's live memory (:mod:`.step_kinds`).

This package may import every other megazero package; none of them imports it.
"""

from megazero.observe.planner import GiB, MemoryEstimate, estimate_memory, estimate_memory_for, plan_of

__all__ = ["GiB", "MemoryEstimate", "estimate_memory", "estimate_memory_for", "plan_of"]
