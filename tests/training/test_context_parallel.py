"""pretrain_gpt.py with --context-parallel-size, compared with the one-process run of the same flags:
per-iteration loss and grad norm within 2e-5 (fp32, dropout 0), for each exchange; and the
refusals at parse time."""

from __future__ import annotations

import pytest

from megazero.training.arguments import parse_args
from megazero.training.config import ConfigError
from tests.training.test_layout_invariance import assert_same_run, data, flags, launch  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope"),
                  tmp_path_factory.mktemp("cp1"), "cp1")


@pytest.mark.parametrize("comm_type,world,extra", [
    ("p2p", 2, []),
    ("a2a", 2, []),
    ("allgather", 2, []),
    ("p2p", 4, ["--zero-stage", "3"]),  # dp 2 x cp 2: ZeRO partitions over data x context
    ("a2a", 4, ["--pipeline-model-parallel-size", "2"]),  # pp 2 x cp 2: the stages pass [s/cp, b, h]
    ("allgather", 4, ["--tp", "2", "--sequence-parallel"]),  # tp 2 (SP) x cp 2
])
def test_context_parallel_equals_one_process(data, one_process, tmp_path, comm_type, world, extra):  # noqa: F811
    args = flags(data, "--num-query-groups", "2", "--position-embedding-type", "rope",
                 "--context-parallel-size", "2", "--cp-comm-type", comm_type, *extra)
    got = launch(world, args, tmp_path, f"cp2_{comm_type}")
    assert_same_run(got, one_process, what=f"cp 2 {comm_type} world {world}")


@pytest.mark.parametrize("argv,message", [
    (["--seq-length", "18", "--max-position-embeddings", "18"], "not divisible by 2 x --context-parallel-size"),
    (["--hidden-dropout", "0.1"], "dropout"),
    (["--cp-comm-type", "a2a", "--num-attention-heads", "6", "--hidden-size", "48", "--context-parallel-size", "4"],
     "a2a"),
    (["--cp-comm-type", "p2p", "--reset-attention-mask"], "reset-attention-mask"),
    (["--cp-comm-type", "p2p", "a2a"], "one exchange per layer"),
    (["--hierarchical-context-parallel-sizes", "2", "2"], "hierarchical"),
])
def test_impossible_context_parallel_settings_are_refused_with_the_numbers(argv, message):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--lr", "1e-3", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--context-parallel-size", "2"]
    with pytest.raises((ConfigError, SystemExit)) as e:
        parse_args(base + argv, world_size=4, check_files=False)
    assert message in str(e.value) or isinstance(e.value, SystemExit), str(e.value)


def test_world_not_divisible_by_tp_cp_pp_is_refused():
    with pytest.raises(ConfigError, match="context-parallel-size 2"):
        parse_args(["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
                    "--max-position-embeddings", "16", "--micro-batch-size", "1", "--lr", "1e-3", "--train-iters",
                    "1", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "64",
                    "--context-parallel-size", "2", "--tp", "2"], world_size=6, check_files=False)
