"""bench_zero --against REF: the ref checked out whole into a temporary worktree that goes away after, and the
command line's defaults (the working tree against HEAD, megazero's own configurations only)."""

import subprocess

import pytest

from benchmarks.bench_zero import ROOT, commit_tree, parse_args


def _git(*argv: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), *argv], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def repository():
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True).returncode != 0:
        pytest.skip("not a git checkout: --against needs the repository's history")


def test_the_ref_is_checked_out_apart_and_removed(repository, tmp_path):
    with commit_tree("HEAD", tmp_path) as tree:  # (HEAD: a shallow clone has no other)
        assert (tree / "benchmarks" / "bench_zero.py").is_file()
        assert _git("-C", str(tree), "rev-parse", "HEAD") == _git("rev-parse", "HEAD")
        assert _git("-C", str(tree), "status", "--porcelain") == ""  # the ref as committed, not this tree's edits
    assert not tree.exists() and str(tree) not in _git("worktree", "list")
    with pytest.raises(SystemExit, match="--against no-such-ref: git worktree add failed"):
        with commit_tree("no-such-ref", tmp_path):
            pass


def test_a_bare_against_measures_the_working_tree_against_head():
    args = parse_args(["--against"])
    assert (args.against, args.configs, args.repeats, args.steps) == ("HEAD", ["megazero tp2"], 4, 20)
    with pytest.raises(SystemExit):
        parse_args(["--against", "HEAD~2", "--configs", "megazero tp2", "FSDP2+TP tp2"])
