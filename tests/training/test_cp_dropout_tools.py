"""Attention dropout under context parallelism at parse time and in the memory tools: Megatron's
default dropout (0.1 attention, 0.1 hidden) is accepted at cp 2 by pretrain_gpt.py's parser,
tools/rehearse.py (the rehearsal of a rank) and tools/estimate_memory.py, with Megatron's masks (the
fused kernels' own) by default at every cp, keyed by position when asked."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megazero.model.attention.cp.layout import plan_blocks, zigzag_layout
from megazero.observe.plan_time import attention_kernel
from megazero.observe.rehearsal import rehearsal_config, rehearse_rank
from megazero.config.arguments import parse_args
from megazero.config.resolve.parallel import context_parallel_dropout_note
from tests.training.test_memory import load_tool

TINY = ["--model-preset", "gpt-tiny", "--mock-data", "--lr", "1e-3", "--micro-batch-size", "2", "--train-iters", "1"]


@pytest.mark.parametrize("extra,rng", [([], "stream"), (["--dropout-rng", "position"], "position"),
                                       (["--cp-comm-type", "a2a"], "stream")])
def test_default_dropout_is_accepted_at_cp2(extra, rng):
    cfg = parse_args(TINY + ["--context-parallel-size", "2", *extra], world_size=2, check_files=False)
    model = cfg.model
    assert (model.attention_dropout, model.hidden_dropout, model.dropout_rng) == (0.1, 0.1, rng)
    note = context_parallel_dropout_note(2, model)
    assert cfg.notes.count(note) == 1  # one start-up line
    assert ("keyed by position" in note) == (rng == "position") and ("depend on the layout" in note) == (rng == "stream")
    assert parse_args(TINY, world_size=1, check_files=False).model.dropout_rng == "stream"  # cp 1: Megatron's


class _FusedAttention(TorchDispatchMode):
    """The dropout probabilities torch's fused CUDA attention ops are called with (flash, memory-efficient)."""

    def __init__(self) -> None:
        super().__init__()
        self.dropout_p: list[float] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._scaled_dot_product_flash_attention.default:
            self.dropout_p.append(args[3])
        elif func is torch.ops.aten._scaled_dot_product_efficient_attention.default:
            self.dropout_p.append(args[5])
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("extra,rng,kernel", [([], "stream", "flash"),
                                              (["--dropout-rng", "position"], "position", "keyed")])
def test_the_memory_tools_run_and_the_planner_prices_the_kernel_the_launch_takes(extra, rng, kernel):
    argv = TINY + ["--context-parallel-size", "2", "--cp-comm-type", "p2p", *extra]
    config, _ = rehearsal_config(argv, 2)
    assert (config.model.attention_dropout, config.model.dropout_rng) == (0.1, rng)
    fused = _FusedAttention()
    with fused:  # below the rehearsal's meta mode, which runs every kernel when it caches none
        assert rehearse_rank(config, 1, cache_kernels=False).peak_bytes > 0
    assert attention_kernel(config.model, flash_attn=True) == kernel  # what tools/plan.py prices
    if kernel == "keyed":  # every block in the explicit formula's tiles, none in a fused op
        assert fused.dropout_p == [], fused.dropout_p
    else:  # the ring's blocks run CUDA's fused op with its own dropout, as on a GPU
        layout = zigzag_layout(config.model.seq_length, 2)
        blocks = sum(len(plan_blocks(layout.runs[1], layout.runs[src])) for src in range(2))  # rank 1's, per layer
        assert fused.dropout_p and set(fused.dropout_p) == {0.1}, fused.dropout_p
        assert len(fused.dropout_p) % (config.model.num_layers * blocks) == 0, (len(fused.dropout_p), blocks)
    assert load_tool("estimate_memory").main(argv + ["--world-size", "2"]) == 0
