"""Lowest-layer utilities (importable by mpu, zero, model and training alike).

Names are imported on first use, so a tool that needs only ``optional_deps`` (the check for
optional packages) does not pay for importing torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

_EXPORTS = {
    "LiveMemoryTracker": "memory_tracker", "MemoryMark": "memory_tracker", "active_tracker": "memory_tracker",
    "peak_memory_source": "memory_tracker", "step_peak_memory": "memory_tracker",
    "missing_packages": "optional_deps", "require_packages": "optional_deps",
    "MetaDeviceMode": "meta_device", "cuda_kernels_on_meta": "meta_device",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # static tools see the real imports
    from megazero.utils.memory_tracker import (  # noqa: F401
        LiveMemoryTracker, MemoryMark, active_tracker, peak_memory_source, step_peak_memory,
    )
    from megazero.utils.meta_device import MetaDeviceMode, cuda_kernels_on_meta  # noqa: F401
    from megazero.utils.optional_deps import missing_packages, require_packages  # noqa: F401


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megazero.utils' has no attribute '{name}'")
    return getattr(importlib.import_module(f"megazero.utils.{module}"), name)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
