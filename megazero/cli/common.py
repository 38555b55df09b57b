"""What the command-line programs share: their help layout and where their messages go."""

from __future__ import annotations

import argparse
import logging
import sys

__all__ = ["HelpFormatter", "setup_logging", "tool_parser", "write_output"]


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written (its examples keep their lines); each option's default after its
    help, where it has one (not None, not a switch's False) and the help does not state it already."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (default is None or default is False or default is argparse.SUPPRESS or not action.option_strings
                or "default" in text or action.nargs == 0):
            return text
        return text + " (default: %(default)s)"


def tool_parser(doc: str, **kwargs) -> argparse.ArgumentParser:
    """An ArgumentParser whose description is a module docstring (``%`` is escaped)."""
    kwargs.setdefault("allow_abbrev", False)
    return argparse.ArgumentParser(description=doc.replace("%", "%%"), formatter_class=HelpFormatter, **kwargs)


def write_output(text: str) -> None:
    """Write ``text`` (and a newline) to stdout now: a program's product, the report or summary a
    user reads or pipes. Deliberately not logging, whose messages go to stderr (:func:`setup_logging`)."""
    sys.stdout.write(text + "\n")
    sys.stdout.flush()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted, so redirections and captures see it."""

    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(logging.Formatter("%(message)s"))

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns it
        pass


def _root_writes_to_stderr() -> bool:
    return any(type(h) is logging.StreamHandler and getattr(h, "stream", None) in (sys.stderr, sys.__stderr__)
               for h in logging.getLogger().handlers)


def setup_logging(level: int = logging.INFO) -> None:
    """The programs' messages (``megazero.*`` loggers, INFO and up) on stderr, one plain line each.

    Idempotent. Records still propagate to the root logger, so an application that configured
    logging sees them too; when its root handler already writes to stderr, nothing is added.
    """
    log = logging.getLogger("megazero")
    if log.level == logging.NOTSET:
        log.setLevel(level)
    if any(isinstance(h, _StderrHandler) for h in log.handlers) or _root_writes_to_stderr():
        return
    log.addHandler(_StderrHandler())
