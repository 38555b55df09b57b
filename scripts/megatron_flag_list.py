"""Write the list of every command-line flag of a Megatron-LM checkout (tests/training/megatron_lm_flags.txt).

    python scripts/megatron_flag_list.py /path/to/Megatron-LM > tests/training/megatron_lm_flags.txt

The flags are read from the parser Megatron-LM itself builds (``megatron.training.arguments.
add_megatron_arguments``: the hand-written flags and the ones generated from its config dataclasses), with the
optional groups switched on (kitchen quantization). Optional GPU packages the checkout imports but this machine
lacks (triton, ...) are stood in for by empty modules: only the parser is built, nothing runs. Every ``'--flag'``
literal of ``arguments.py`` must be among the flags found, or the script stops naming the ones missing.

Each line: the flag; ``switch`` (takes no value), ``value`` (one), ``values`` (one or more) or how many it takes;
and Megatron's choices (comma-separated) when it has any. Every alias has its own line.
tests/training/test_megatron_flags.py checks that megazero's parser answers each one.
"""

from __future__ import annotations

import argparse
import enum
import importlib.abc
import importlib.machinery
import os
import re
import subprocess
import sys
import typing
from unittest import mock

STAND_INS = {"triton"}  # optional GPU packages megatron.core imports at module level


class _StandIn(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An empty (permissive) module for each missing package in STAND_INS."""

    def find_spec(self, name, path, target=None):
        if name.split(".")[0] not in STAND_INS:
            return None
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__, module.__name__, module.__version__ = [], spec, spec.name, "3.0.0"
        return module

    def exec_module(self, module) -> None:
        pass


def megatron_parser(checkout: str) -> argparse.ArgumentParser:
    """The parser ``checkout``'s pretrain scripts build."""
    import functorch.compile  # noqa: F401  (torch probes for triton itself: before the stand-ins)
    import torch._dynamo  # noqa: F401
    import torch._inductor.compile_fx  # noqa: F401
    import torch.utils.flop_counter  # noqa: F401

    typing.override = getattr(typing, "override", lambda f: f)  # Python 3.12's, for older interpreters
    sys.meta_path.append(_StandIn())
    sys.path.insert(0, checkout)
    import megatron.core.extensions.kitchen as kitchen

    kitchen.HAVE_KITCHEN = True  # the kitchen group is added only where its package is installed
    kitchen.KitchenSpecProvider = getattr(kitchen, "KitchenSpecProvider", object)
    from megatron.training.arguments import add_megatron_arguments

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_megatron_arguments(parser)
    return parser


def _choice(c) -> str:
    return c.name if isinstance(c, enum.Enum) else str(c)  # an enum's flag takes its member's name


def lines(parser: argparse.ArgumentParser) -> list[str]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        n = action.nargs
        kind = "switch" if n == 0 else str(n) if isinstance(n, int) else "values" if n in ("+", "*") else "value"
        choices = "" if not action.choices else " " + ",".join(_choice(c) for c in action.choices)
        out += [f"{name} {kind}{choices}" for name in action.option_strings]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("checkout", help="a Megatron-LM checkout (git clone https://github.com/NVIDIA/Megatron-LM)")
    checkout = os.path.abspath(ap.parse_args(argv).checkout)
    parser = megatron_parser(checkout)
    found = lines(parser)
    source = open(os.path.join(checkout, "megatron", "training", "arguments.py")).read()
    names = {line.split()[0] for line in found}
    missing = sorted(set(re.findall(r"""['"](--[A-Za-z0-9][\w-]*)['"]""", source)) - names)
    if missing:
        sys.exit(f"flags in arguments.py that the built parser lacks (a group added conditionally?): {missing}")
    commit = subprocess.run(["git", "-C", checkout, "log", "-1", "--format=%H %cs"], capture_output=True,
                            text=True).stdout.strip() or "unknown"
    sys.stdout.write(
        f"# Every command-line flag of Megatron-LM's megatron/training/arguments.py at NVIDIA/Megatron-LM {commit}\n"
        "# (add_megatron_arguments: its own flags, those generated from its config dataclasses, the kitchen group).\n"
        "# Regenerate: python scripts/megatron_flag_list.py MEGATRON_LM_CHECKOUT "
        "> tests/training/megatron_lm_flags.txt\n"
        "# Each line: flag; switch (no value), value (one), values (one or more) or how many; Megatron's choices.\n"
        + "".join(line + "\n" for line in found))


if __name__ == "__main__":
    main()
