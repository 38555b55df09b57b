"""The training layer's user-facing error, in a module of its own so that every other module
(``config``, ``ds_keys``, ``flags``, ``arguments``, ...) can raise it without importing one another."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A command line / config that cannot run. The message says what and how to fix it."""
