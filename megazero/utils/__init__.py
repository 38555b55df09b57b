"""Lowest-layer utilities (importable by mpu, zero, model and training alike)."""

from .memory_tracker import LiveMemoryTracker, MemoryMark, active_tracker, peak_memory_source, step_peak_memory

__all__ = ["LiveMemoryTracker", "MemoryMark", "active_tracker", "peak_memory_source", "step_peak_memory"]
