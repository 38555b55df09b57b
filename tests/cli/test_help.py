"""--help of every program: it builds, shows defaults where there are some, and pretrain_gpt.py's leaves the
refused and no-effect flags to docs/flags.md while still refusing them with their message."""

from __future__ import annotations

import dataclasses
import re

import pytest

from megazero.config.arguments import ConfigError, parse_args, parse_args_or_exit
from megazero.config.flags import FLAGS, REFUSED, _shown
from megazero.zero.optimizers import registered
from tests.cli.programs import PROGRAMS, ROOT, parser

TINY = ("--mock-data --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 1 --train-iters 10 --lr 1e-3 "
        "--tokenizer-type NullTokenizer --vocab-size 100").split()


@pytest.fixture(scope="module")
def pretrain_help() -> str:
    return parser("pretrain_gpt").format_help()


def _option_lines(text: str) -> set[str]:
    """The flags that have an entry of their own in a help text."""
    return set(re.findall(r"^ {2}(--?[\w-]+)", text, re.M)) | set(re.findall(r", (--[\w-]+)", text))


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_program_has_help(name):
    text = parser(name).format_help()
    assert text.startswith("usage: ") and "--help" in text
    assert "%(" not in text  # the description's text reached the help as written


def test_tool_help_shows_defaults_where_there_are_some():
    """The planning tools list pretrain_gpt.py's flags as it does, and their own with the same
    --device-memory-gb default."""
    for name, consequence in (("estimate_memory", "a larger total with the NCCL estimate exits 1"),
                              ("rehearse", "a larger peak plus the NCCL estimate exits 1")):
        text = re.sub(r"\s+", " ", parser(name).format_help())
        assert "--zero-stage ZERO_STAGE [honoured] ZeRO stage 0-3 over the data-parallel group" in text, name
        assert "(default: None)" not in text and "(default: False)" not in text
        assert (f"--device-memory-gb DEVICE_MEMORY_GB, --gpu-memory-gb DEVICE_MEMORY_GB device capacity in GiB "
                f"(an '80GB' GPU is 80 GiB): {consequence} (default: 80, the same in tools/estimate_memory.py and "
                f"tools/rehearse.py)") in text, name
        assert parser(name).get_default("device_memory_gb") == 80
        assert f"{name}.py's own flags (the others are pretrain_gpt.py's)" in text


def test_pretrain_help_shows_real_flags_with_their_defaults(pretrain_help):
    one_line = re.sub(r"\s+", " ", pretrain_help)
    assert "--seed SEED [honoured] random seed (default: 1234)" in one_line
    assert "--tensor-model-parallel-size TP, --tp TP [honoured] tensor-parallel size (default: 1)" in one_line
    assert "--lr-decay-style {constant,linear,cosine,inverse-square-root,WSD}" in one_line
    assert "(default: None)" not in one_line


def test_pretrain_help_leaves_refused_and_no_effect_flags_to_the_docs(pretrain_help):
    listed = _option_lines(pretrain_help)
    refused = {n for f in FLAGS if f.status == REFUSED for n in f.names}
    hidden = {n for f in FLAGS if not f.in_help for n in f.names}
    assert refused <= hidden and "--moe-token-dropping" in refused and "--deepspeed" in hidden
    assert not listed & hidden, sorted(listed & hidden)
    shown = {n for f in FLAGS if f.in_help for n in f.names}
    assert shown <= listed, sorted(shown - listed)
    assert "docs/flags.md" in pretrain_help.strip().splitlines()[-1]
    docs = (ROOT / "docs" / "flags.md").read_text()
    assert all(f"`{n}`" in docs for n in hidden)


def test_a_refused_flag_still_exits_2_with_its_message(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args_or_exit(TINY + ["--moe-token-dropping"], 1, check_files=False)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--moe-token-dropping: DeepSpeed-MoE's switch" in err


# Flags whose default only applies beside others (flags given with the default, and instead of ones in TINY).
CONTEXT = {
    "--virtual-pipeline-model-parallel-size": (["--pp", "2"], ()),
    "--recompute-method": (["--recompute-granularity", "full"], ()),
    "--recompute-num-layers": (["--recompute-granularity", "full"], ()),
    "--lr-wsd-decay-style": (["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "2"], ()),
    "--lr-warmup-samples": (["--train-samples", "10"], ("--train-iters",)),
    # an optimizer's own flags beside that optimizer (each component says which flags are its own)
    **{f"--{dest.replace('_', '-')}": (["--optimizer", kind.cli_names[0]], ()) for kind in registered()
       for dest in kind.flag_dests()},
    "--qk-clip-threshold": (["--qk-clip"], ()),
    "--qk-clip-alpha": (["--qk-clip"], ()),
    "--optimizer-offload-fraction": (["--optimizer-cpu-offload"], ()),
    "--split": (["--data-path", "corpus_text_document"], ("--mock-data",)),  # file data: mock data has no split
    "--mock-data": (["--tokenizer-type", "NullTokenizer"], ()),  # the shown --split default is refused beside it
}


def _without(argv: list[str], flags) -> list[str]:
    """``argv`` less ``flags`` and their values."""
    out, skip = [], False
    for word in argv:
        if skip and not word.startswith("-"):
            skip = False
        elif word in flags:
            skip = True
        else:
            skip = False
            out.append(word)
    return out


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.default is not None], ids=lambda f: f.names[0])
def test_the_default_shown_is_the_one_in_force(flag):
    """Giving a flag its shown default resolves to the same configuration as leaving it out."""
    extra, drop = CONTEXT.get(flag.names[0], ([], ()))
    base = _without(TINY, drop) + extra
    world = 2 if "--pp" in extra else 1
    without = parse_args(base, world, check_files=False)
    given = parse_args(base + [flag.names[0], _shown(flag.default)], world, check_files=False)
    assert _in_force(given) == _in_force(without)


def _in_force(cfg):
    """The configuration (notes aside) and the engine's own, defaults filled in. The offload fraction is
    compared there only: unset, the engine's ratio default (1) applies."""
    optim = dataclasses.replace(cfg.optim, offload_fraction=None)
    return dataclasses.replace(cfg, notes=[], optim=optim), cfg.zero_config()


def test_a_wrong_default_would_be_seen():
    with pytest.raises(AssertionError):
        assert parse_args(TINY + ["--seed", "1"], 1, check_files=False) == parse_args(TINY, 1, check_files=False)
    with pytest.raises(ConfigError):
        parse_args(TINY + ["--moe-token-dropping"], 1, check_files=False)
