"""megazero: a Megatron-style model-parallel GPT trainer with its own ZeRO optimizer.

The subpackages (``megazero.model``, ``megazero.zero``, ``megazero.training``, ...) are imported
by name; this module holds the version and checks, once at import, that the installed torch is
new enough. The check reads torch's version without importing torch, so a tool that needs no
torch (``tools/plot_metrics.py`` through ``megazero.utils.optional_deps``) stays cheap.
"""

from __future__ import annotations

import os
import re
import sys

__version__ = "0.1.0"

__all__ = ["TORCH_FLOOR", "__version__", "check_torch_version", "parse_version"]

# The oldest torch megazero runs on; pyproject.toml's dependency says the same (a test keeps them
# in step), and it explains the choice.
TORCH_FLOOR = (2, 6)


def parse_version(version: str) -> tuple[int, ...]:
    """The release numbers of a PEP 440 version string: ``"2.13.0+cpu"`` -> ``(2, 13, 0)``.

    The epoch, pre-release, dev and local parts are dropped, so NGC's ``"2.6.0a0+ecf3bae40a"``, a
    source build's ``"2.6.0a0+git1234"`` and a nightly ``"2.6.0.dev20241101"`` all read as 2.6.0
    (as pip reads them against ``torch>=2.6.0.dev0``). ``()`` when no number leads the string."""
    release = version.strip().split("+", 1)[0].split("!")[-1]
    numbers = []
    for part in release.split("."):
        digits = len(part) - len(part.lstrip("0123456789"))
        if digits == 0:
            break
        numbers.append(int(part[:digits]))
        if digits < len(part):  # "0a0", "0rc1", "0dev1": the release ends in this part
            break
    return tuple(numbers)


def _installed_torch_version() -> str | None:
    """torch's ``__version__`` without importing torch: the imported module's when there is one, else
    the ``__version__`` line of the ``torch/version.py`` an import would load (what torch's build
    writes), else the installed distribution's metadata. None when there is no torch."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(getattr(torch, "__version__", None), str):
        return torch.__version__
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError):
        spec = None
    if spec is None:  # no torch here: the first `import torch` says so
        return None
    for folder in spec.submodule_search_locations or ():
        try:
            with open(os.path.join(folder, "version.py"), encoding="utf-8") as f:
                found = re.search(r"^__version__\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)['\"]", f.read(), re.MULTILINE)
        except OSError:
            continue
        if found:
            return found.group(1)
    from importlib import metadata

    try:
        return metadata.version("torch")
    except metadata.PackageNotFoundError:
        return None


def check_torch_version(version: str | None = None) -> None:
    """Raise ImportError, in one line, if torch ``version`` (default: the installed one) is older
    than ``TORCH_FLOOR``. A version that does not parse is let through."""
    if version is None:
        version = _installed_torch_version()
        if version is None:
            return
    found = parse_version(version)
    if not found:
        return
    width = max(len(found), len(TORCH_FLOOR))
    if found + (0,) * (width - len(found)) < TORCH_FLOOR + (0,) * (width - len(TORCH_FLOOR)):
        floor = ".".join(map(str, TORCH_FLOOR))
        raise ImportError(f"megazero needs torch>={floor} (found {version}): pip install 'torch>={floor}' "
                          f"(pick the build for your CUDA at https://pytorch.org/get-started/locally/)")


check_torch_version()
