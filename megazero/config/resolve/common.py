"""Small helpers shared by the resolvers: defaults, JSON look-ups, value comparison."""

from __future__ import annotations

import math
from typing import Any


def default(value: Any, fallback: Any) -> Any:
    return fallback if value is None else value


def json_get(d: Any, path: str) -> Any:
    for part in path.split("."):
        if isinstance(d, list) and part.isdigit() and int(part) < len(d):
            d = d[int(part)]
        elif isinstance(d, dict) and part in d:
            d = d[part]
        else:
            return None
    return None if d == "auto" else d  # HF-style "auto" means "take it from the command line"


def same_value(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        return a is not None and b is not None and math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
    return a == b
