"""Attention dropout under context parallelism at parse time and in the memory tools: Megatron's
default dropout (0.1 attention, 0.1 hidden) is accepted at cp 2 by pretrain_gpt.py's parser,
tools/rehearse.py (the rehearsal of a rank) and tools/estimate_memory.py, keyed by position by default."""

from __future__ import annotations

import pytest

from megazero.observe.rehearsal import rehearsal_config, rehearse_rank
from megazero.training.arguments import parse_args
from megazero.training.resolve.parallel import context_parallel_dropout_note
from tests.training.test_memory import load_tool

TINY = ["--model-preset", "gpt-tiny", "--mock-data", "--lr", "1e-3", "--micro-batch-size", "2", "--train-iters", "1"]


@pytest.mark.parametrize("extra,rng", [([], "position"), (["--dropout-rng", "stream"], "stream"),
                                       (["--cp-comm-type", "a2a"], "position")])
def test_default_dropout_is_accepted_at_cp2(extra, rng):
    cfg = parse_args(TINY + ["--context-parallel-size", "2", *extra], world_size=2, check_files=False)
    model = cfg.model
    assert (model.attention_dropout, model.hidden_dropout, model.dropout_rng) == (0.1, 0.1, rng)
    note = context_parallel_dropout_note(2, model)
    assert cfg.notes.count(note) == 1  # one start-up line
    assert ("keyed by position" in note) == (rng == "position") and ("depend on the layout" in note) == (rng == "stream")
    assert parse_args(TINY, world_size=1, check_files=False).model.dropout_rng == "stream"  # cp 1: Megatron's


def test_the_memory_tools_accept_attention_dropout_under_context_parallelism():
    argv = TINY + ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]
    config, _ = rehearsal_config(argv, 2)
    assert (config.model.attention_dropout, config.model.dropout_rng) == (0.1, "position")
    assert rehearse_rank(config, 1).peak_bytes > 0
    assert load_tool("estimate_memory").main(argv + ["--world-size", "2"]) == 0
