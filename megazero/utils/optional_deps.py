"""Optional packages a tool needs, checked before it does any work.

A missing optional package found half-way (transformers' SentencePiece conversion without
protobuf ends in "`tiktoken` is required to read a `tiktoken` file") is a traceback that
names the wrong package. ``require_packages`` looks the modules up first (``find_spec``: nothing
is imported) and, if any is missing, prints one line naming the package(s) and two install
commands that work (megazero is installed from a checkout, not from PyPI, so ``pip install
'megazero[hf]'`` would not): ``pip install <the missing packages>``, or the megazero extra that
declares them, ``pip install -e '.[hf]'`` from the checkout; then exits with status 2.
"""

from __future__ import annotations

import importlib.util
import sys
from typing import Sequence

__all__ = ["PIP_NAMES", "install_hint", "missing_packages", "missing_message", "require_packages"]

# import name -> the name pip installs it under, where they differ
PIP_NAMES = {"google.protobuf": "protobuf"}


def missing_packages(modules: Sequence[str]) -> list[str]:
    """The pip names of the ``modules`` (import names) that cannot be imported here."""
    missing = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # a parent package is missing, or a module has no spec
            found = False
        if not found:
            missing.append(PIP_NAMES.get(module, module))
    return missing


def missing_message(tool: str, modules: Sequence[str], extra: str, purpose: str = "") -> str | None:
    """The one-line message for the missing ``modules`` (None when all are there)."""
    missing = missing_packages(modules)
    if not missing:
        return None
    names = " and ".join(missing)
    what = f"the {names} package{'s' if len(missing) > 1 else ''}"
    return (f"{tool}: error: {purpose + ' ' if purpose else ''}needs {what}, which {'are' if len(missing) > 1 else 'is'} "
            f"not installed: {install_hint(missing, extra)}")


def install_hint(packages: Sequence[str], extra: str) -> str:
    """``pip install <packages> (or pip install -e '.[extra]' in the megazero checkout)``."""
    return f"pip install {' '.join(packages)} (or pip install -e '.[{extra}]' in the megazero checkout)"


def require_packages(tool: str, modules: Sequence[str], extra: str, purpose: str = "") -> None:
    """Return if every module in ``modules`` can be imported; else print one line on stderr naming the
    missing package(s) and how to install them (:func:`install_hint`), and exit with status 2."""
    message = missing_message(tool, modules, extra, purpose)
    if message is not None:
        print(message, file=sys.stderr)
        raise SystemExit(2)
