"""The configuration's user-facing error, in a module of its own so that every other module
(``config``, ``ds_keys``, ``flags``, ``arguments``, ...) can raise it without importing one another."""

from __future__ import annotations

__all__ = ["ConfigError"]


class ConfigError(ValueError):
    """A command line / config that cannot run. The message says what and how to fix it."""

    user_facing = True  # the message says what was wrong and how to fix it: no traceback
