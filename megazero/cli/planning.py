"""What the planning tools share (tools/estimate_memory.py, tools/rehearse.py): pretrain_gpt.py's flags.

Both take exactly the command line ``pretrain_gpt.py`` would get, validated as it validates it
(``parse_args(..., check_files=False, planning=True)``: no data or tokenizer files looked for, and the
training-only flags, learning rate, run length, data and tokenizer, may be left out), beside a few
flags of their own. The two sets share no name, so the tools tell them apart wherever they stand.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Callable, NoReturn, Optional, Sequence, Union

from megazero.cli.common import HelpFormatter, setup_logging
from megazero.config.arguments import build_parser as pretrain_parser
from megazero.config.arguments import parse_args
from megazero.config.train_config import ConfigError, TrainConfig

__all__ = ["DEVICE_MEMORY_GIB", "add_device_memory", "planning_parser", "split_own", "plan_config", "tool_args"]

log = logging.getLogger(__name__)

DEVICE_MEMORY_GIB = 80.0  # the default capacity of both tools' fit check (an "80 GB" GPU)


class _OwnFlags(argparse.ArgumentParser):
    """A tool's own flags alone: its errors are ConfigErrors (one line), the other words are left over."""

    def error(self, message: str) -> NoReturn:
        raise ConfigError(message)


def add_device_memory(add: Callable, consequence: str) -> None:
    """``--device-memory-gb`` as both tools take it (the same default)."""
    add("--device-memory-gb", "--gpu-memory-gb", dest="device_memory_gb", type=float, default=DEVICE_MEMORY_GIB,
        help=f"device capacity in GiB (an '80GB' GPU is 80 GiB): {consequence} (default: {DEVICE_MEMORY_GIB:g}, the "
             f"same in tools/estimate_memory.py and tools/rehearse.py)")


def planning_parser(prog: str, doc: str, add_own: Callable[[Callable], None]) -> argparse.ArgumentParser:
    """pretrain_gpt.py's parser with the tool's own flags (``add_own(add_argument)``) in a group of their
    own: the tool's --help, and the flags an unknown one is compared with."""
    p = pretrain_parser()
    p.prog, p.description, p.formatter_class = prog, doc.replace("%", "%%"), HelpFormatter
    p.usage = f"%(prog)s [{prog}'s flags] [pretrain_gpt.py's flags]"
    add_own(p.add_argument_group(f"{prog}'s own flags (the others are pretrain_gpt.py's)").add_argument)
    return p


def split_own(words: Sequence[str], add_own: Callable[[Callable], None]) -> tuple[argparse.Namespace, list[str]]:
    """(the tool's own flags, the rest: pretrain_gpt.py's words, in their order)."""
    own = _OwnFlags(add_help=False, allow_abbrev=False)
    add_own(own.add_argument)
    return own.parse_known_args(list(words))


def plan_config(words: Sequence[str], world_size: int, parser: argparse.ArgumentParser) -> TrainConfig:
    """pretrain_gpt.py's ``words`` for ``world_size`` ranks, as it would resolve them, for a plan."""
    return parse_args(list(words), world_size, check_files=False, planning=True, parser=parser)




def tool_args(argv: Optional[Sequence[str]], build_parser: Callable[[], argparse.ArgumentParser],
              add_own: Callable[[Callable], None]) -> Union[int, tuple[argparse.Namespace, list[str]]]:
    """A planning tool's command line (``argv``, else ``sys.argv[1:]``), its logging set up: (its own flags,
    pretrain_gpt.py's words), or the exit status when there is nothing more to do (0 once ``--help`` has
    printed the help, 2 after one line on a bad flag of its own)."""
    words = list(sys.argv[1:] if argv is None else argv)
    setup_logging()
    if "-h" in words or "--help" in words:
        build_parser().print_help()
        return 0
    try:
        return split_own(words, add_own)
    except ConfigError as e:
        log.error("error: %s", e)
        return 2
