"""The documentation runs as written: README.md, docs/*.md and examples/**/README.md.

* every ``--flag`` on a line of a fenced code block that runs ``pretrain_gpt.py`` (continuation
  lines ending in ``\\`` included) is a flag pretrain_gpt.py accepts (refused flags do not count);
* the same for ``tools/<x>.py`` (or its ``megazero-<x>`` console script) against that tool's parser;
  flags after a bare ``--`` (tools/rehearse.py) or after ``--train-args`` (tools/estimate_memory.py,
  tools/estimate_startup.py) are pretrain_gpt.py's;
* every relative path in a markdown link, and every repository path in backticks or in a fenced
  command (``tools/rehearse.py``, ``examples/azure/run_gpt_13b.sh``, ``docs/flags.md``), exists.

In-process and fast: the parsers are built, nothing is launched.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib
import importlib.util
import io
import pathlib
import re
import shlex

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted({ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("examples/**/README.md")})
TOOLS = sorted(p.stem for p in (ROOT / "tools").glob("*.py"))
# A backticked or fenced word is taken for a repository path when its first component is one of these.
TOP_LEVEL = ("megazero", "tools", "examples", "docs", "scripts", "tests", "benchmarks")
SEPARATORS = {"|", "||", "&", "&&", ";", ";;", "(", ")", ">", ">>", "<", "2>", "2>&1"}
NON_SHELL_FENCES = {"python", "py", "json", "text", "console-output", "output"}


def _doc_id(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT))


# ------------------------------------------------------------------------------------------ parsing docs

def fenced_commands(path: pathlib.Path) -> list[tuple[int, str]]:
    """(first line number, command) of every shell line in the fenced code blocks, continuations joined."""
    out: list[tuple[int, str]] = []
    fence = None
    pending, start = "", 0
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            m = re.match(r"^(`{3,}|~{3,})\s*([\w+-]*)", stripped)
            if m:
                fence = (m.group(1), m.group(2).lower())
            continue
        if stripped.startswith(fence[0]):
            if pending:
                out.append((start, pending))
            fence, pending = None, ""
            continue
        if fence[1] in NON_SHELL_FENCES:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        out.append((start, pending + stripped))
        pending = ""
    return out


def prose_lines(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside fenced code blocks."""
    out, fence = [], None
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        m = re.match(r"^\s*(`{3,}|~{3,})", line)
        if fence is None and m:
            fence = m.group(1)
            continue
        if fence is not None:
            if line.strip().startswith(fence):
                fence = None
            continue
        out.append((number, line))
    return out


def tokens(command: str) -> list[str]:
    lexer = shlex.shlex(command, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    try:
        return list(lexer)
    except ValueError:  # an unbalanced quote: fall back to whitespace
        return command.split("#")[0].split()


def invocations(command: str) -> list[tuple[str, list[str]]]:
    """(program, arguments) for each pretrain_gpt.py (or Megatron's hybrid names of it, pretrain_hybrid.py and
    pretrain_mamba.py) / tools/<x>.py / megazero-<x> run on the line; program is "pretrain_gpt" or the tool's module
    name."""
    found = []
    words = tokens(command)
    i = 0
    while i < len(words):
        word = words[i]
        name = None
        if word.endswith(("pretrain_gpt.py", "pretrain_hybrid.py", "pretrain_mamba.py")) \
                or word == "megazero-pretrain-gpt":
            name = "pretrain_gpt"
        else:
            m = re.search(r"(?:^|/)tools/(\w+)\.py$", word) or re.fullmatch(r"megazero-([\w-]+)", word)
            if m and m.group(1).replace("-", "_") in TOOLS:
                name = m.group(1).replace("-", "_")
        if name is None:
            i += 1
            continue
        j = i + 1
        while j < len(words) and words[j] not in SEPARATORS:
            j += 1
        found.append((name, words[i + 1:j]))
        i = j
    return found


def split_flags(program: str, args: list[str]) -> list[tuple[str, str]]:
    """(program, flag) for every --flag in args; the part after '--' or '--train-args' is pretrain_gpt's."""
    out, owner = [], program
    for arg in args:
        if arg == "--":
            owner = "pretrain_gpt"
            continue
        if not re.match(r"^--[A-Za-z]", arg):
            continue
        flag = arg.split("=", 1)[0]
        out.append((owner, flag))
        if flag == "--train-args":
            owner = "pretrain_gpt"
    return out


# ------------------------------------------------------------------------------------------ the parsers

class _Captured(Exception):
    def __init__(self, parser: argparse.ArgumentParser) -> None:
        super().__init__("parser captured")
        self.parser = parser


def _options(parser: argparse.ArgumentParser) -> frozenset[str]:
    return frozenset(s for action in parser._actions for s in action.option_strings)


@functools.lru_cache(maxsize=None)
def accepted(program: str) -> frozenset[str]:
    """The option strings ``program`` accepts."""
    if program == "pretrain_gpt":
        from megazero.config.flags import FLAGS, REFUSED

        return frozenset({"-h", "--help"} | {n for f in FLAGS if f.status != REFUSED for n in f.names})
    # 1. megazero.cli.<tool>.build_parser(), where the console scripts live
    with contextlib.suppress(ImportError):
        module = importlib.import_module(f"megazero.cli.{program}")
        if hasattr(module, "build_parser"):
            return _options(module.build_parser())
    # 2. the script itself: its build_parser(), or the parser its main() builds (captured, not run)
    spec = importlib.util.spec_from_file_location(f"_docs_tool_{program}", ROOT / "tools" / f"{program}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if hasattr(module, "build_parser"):
        return _options(module.build_parser())

    def capture(self, *args, **kwargs):
        raise _Captured(self)

    saved = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = capture
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            module.main([])
    except _Captured as c:
        return _options(c.parser)
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = saved
    raise AssertionError(f"tools/{program}.py: no build_parser() and main() built no parser")


# ------------------------------------------------------------------------------------------ paths

def _repo_path_words(text: str) -> list[str]:
    """Words of ``text`` that look like repository paths (see TOP_LEVEL)."""
    out = []
    for word in re.split(r"[\s\"'=,()]+", text):
        word = word.rstrip(".,;:")
        if not word or any(c in word for c in "$<>{}[]|") or "://" in word:
            continue
        word = re.sub(r"(::\w+|:\d+(-\d+)?|#[\w-]*)$", "", word)
        if word.startswith("./"):
            word = word[2:]
        if "/" not in word or word.split("/")[0] not in TOP_LEVEL:
            continue
        if word.endswith("/") or re.search(r"\.\w+$", word.rsplit("/", 1)[-1]):
            out.append(word)
    return out


def _exists(base: pathlib.Path, path: str) -> bool:
    if "*" in path or "?" in path:
        return any(base.glob(path.rstrip("/")))
    return (base / path).exists()


def bad_paths(doc: pathlib.Path) -> list[str]:
    bad = []
    for number, line in prose_lines(doc):
        for target in re.findall(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", line):
            if re.match(r"^[a-z][\w+.-]*:", target) or target.startswith("#"):
                continue  # a URL, mailto:, or an anchor in this page
            path = target.split("#", 1)[0]
            if path and not _exists(doc.parent, path):
                bad.append(f"{_doc_id(doc)}:{number}: link target '{target}' does not exist")
        for span in re.findall(r"`([^`]+)`", line):
            for path in _repo_path_words(span):
                if not (_exists(ROOT, path) or _exists(doc.parent, path)):
                    bad.append(f"{_doc_id(doc)}:{number}: path `{path}` does not exist")
    for number, command in fenced_commands(doc):
        for path in _repo_path_words(command):
            if not _exists(ROOT, path):
                bad.append(f"{_doc_id(doc)}:{number}: path {path} (in a code block) does not exist")
    return bad


# ------------------------------------------------------------------------------------------ tests

def test_docs_are_found():
    names = {_doc_id(d) for d in DOCS}
    assert "README.md" in names and "docs/README.md" in names, names


def unknown_flags(doc: pathlib.Path, pretrain: bool) -> list[str]:
    """``doc:line: message`` for each flag of a pretrain_gpt.py (``pretrain``) or tools/ command in
    ``doc``'s code blocks that its program does not accept."""
    bad = []
    for number, command in fenced_commands(doc):
        for program, args in invocations(command):
            for owner, flag in split_flags(program, args):
                if (owner == "pretrain_gpt") == pretrain and flag not in accepted(owner):
                    where = "pretrain_gpt.py accepts" if pretrain else f"of tools/{owner}.py"
                    bad.append(f"{_doc_id(doc)}:{number}: {flag} is not a flag {where}")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_pretrain_gpt_flags_in_code_blocks_exist(doc):
    bad = unknown_flags(doc, pretrain=True)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_tool_flags_in_code_blocks_exist(doc):
    bad = unknown_flags(doc, pretrain=False)
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_paths_exist(doc):
    bad = bad_paths(doc)
    assert not bad, "\n".join(bad)


def test_the_checks_see_what_they_should():
    """The extraction itself: continuation lines, launchers, '--' and --train-args, paths."""
    line = ("torchrun --nproc_per_node 8 pretrain_gpt.py --tp 4 --bogus=1 && "
            "python tools/rehearse.py --world-size 8 -- --pp 2 | tee log")
    runs = invocations(line)
    assert [name for name, _ in runs] == ["pretrain_gpt", "rehearse"]
    assert split_flags(*runs[0]) == [("pretrain_gpt", "--tp"), ("pretrain_gpt", "--bogus")]
    assert split_flags(*runs[1]) == [("rehearse", "--world-size"), ("pretrain_gpt", "--pp")]
    assert "--bogus" not in accepted("pretrain_gpt") and "--tp" in accepted("pretrain_gpt")
    assert "--moe-token-dropping" not in accepted("pretrain_gpt")  # refused: not usable
    assert "--world-size" in accepted("rehearse")
    assert _repo_path_words("see tools/rehearse.py, examples/azure/ and SAVE/iter_0000100/ or data/x.bin") == [
        "tools/rehearse.py", "examples/azure/"]


# Megatron's --eval-iters default (100) on the validation and the test split at the end of training:
# a run of a few hundred iterations without a small --eval-iters spends most of its time evaluating.
SHORT_RUN_ITERS, SHORT_EVAL_ITERS = 1000, 10


def _value(args: list[str], flag: str):
    """The integer after ``flag`` in ``args`` (either spelling), None when absent or not a number."""
    for i, arg in enumerate(args):
        text = arg.split("=", 1)[1] if arg.startswith(flag + "=") else args[i + 1] if arg == flag and i + 1 < len(args) else None
        if text is not None:
            return int(text) if text.isdigit() else None
    return None


def long_evaluations(doc: pathlib.Path) -> list[str]:
    """``doc:line: message`` for each pretrain_gpt.py run in ``doc``'s code blocks of at most
    SHORT_RUN_ITERS iterations that does not keep --eval-iters at SHORT_EVAL_ITERS or fewer."""
    bad = []
    for number, command in fenced_commands(doc):
        for program, args in invocations(command):
            iters = _value(args, "--train-iters")
            if program != "pretrain_gpt" or iters is None or iters > SHORT_RUN_ITERS:
                continue
            evals = _value(args, "--eval-iters")
            if evals is None or evals > SHORT_EVAL_ITERS:
                bad.append(f"{_doc_id(doc)}:{number}: a {iters}-iteration run without --eval-iters <= "
                           f"{SHORT_EVAL_ITERS} evaluates 100 batches on two splits (Megatron's default)")
    return bad


@pytest.mark.parametrize("doc", DOCS, ids=_doc_id)
def test_short_runs_in_code_blocks_evaluate_briefly(doc):
    bad = long_evaluations(doc)
    assert not bad, "\n".join(bad)


def test_every_recipe_is_indexed():
    recipes = sorted(p.name for p in (ROOT / "examples" / "recipes").glob("*.sh") if p.name != "common.sh")
    assert recipes, "examples/recipes/ holds no recipe"
    for index in ("examples/README.md", "docs/README.md"):
        text = (ROOT / index).read_text(encoding="utf-8")
        assert [r for r in recipes if f"recipes/{r}" not in text] == [], index
    docs_index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8").lower()
    assert "context parallelism" in docs_index and "mixture of experts" in docs_index


def test_the_plan_docs_memory_md_quotes_is_what_its_command_prints(capsys):
    """docs/memory.md's tools/estimate_memory.py command, run as written (in-process): the total and the total
    with the NCCL estimate it prints are the figures the page quotes. (The 13B dry run's figures in
    docs/memory.md and docs/parallelism.md: tests/training/test_memory.py, which launches the script.)"""
    from megazero.cli.estimate_memory import main

    doc = ROOT / "docs" / "memory.md"
    runs = [args for _, command in fenced_commands(doc) for program, args in invocations(command)
            if program == "estimate_memory"]
    assert len(runs) == 1, runs
    assert main(runs[0]) == 0
    out = capsys.readouterr().out
    total = re.search(r"^  total +([\d.]+)$", out, re.M).group(1)
    with_nccl = re.search(r"^  total with NCCL +([\d.]+)$", out, re.M).group(1)
    prose = " ".join(doc.read_text(encoding="utf-8").split())
    assert f"{total} GiB per GPU in total, {with_nccl} GiB with the NCCL communicators' estimate" in prose
