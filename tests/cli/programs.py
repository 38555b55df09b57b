"""The programs of megazero/cli (one per tools/*.py, and pretrain_gpt.py) and helpers to parse their flags."""

from __future__ import annotations

import argparse
import importlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOOLS = sorted(p.stem for p in (ROOT / "tools").glob("*.py"))
PROGRAMS = ["pretrain_gpt"] + TOOLS


def program(name: str):
    return importlib.import_module(f"megazero.cli.{name}")


def parser(name: str) -> argparse.ArgumentParser:
    return program(name).build_parser()


def sample_value(action: argparse.Action) -> list[str]:
    """Command-line words that ``action`` accepts (none for a switch)."""
    if action.nargs == 0:
        return []
    if action.choices:
        value = str(next(iter(action.choices)))
    else:
        value = "x"
        for candidate in ("3", "0.5", "a=1", "x"):
            try:
                if action.type is not None:
                    action.type(candidate)
                value = candidate
                break
            except (ValueError, TypeError, argparse.ArgumentTypeError):
                continue
    return [value] * (action.nargs if isinstance(action.nargs, int) else 1)


def required_words(p: argparse.ArgumentParser) -> list[str]:
    """Positionals and required options, each with a value it accepts."""
    words: list[str] = []
    for action in p._actions:
        if not action.option_strings and action.nargs != argparse.REMAINDER:
            words += sample_value(action)
    for action in p._actions:
        if action.option_strings and action.required:
            words += [action.option_strings[0], *sample_value(action)]
    return words
