"""bench_zero --against's load-independent measures of a step's work: Python bytecodes and tensor operations."""

import torch

from benchmarks.zero_baselines import ComputeTimer, count_opcodes


def _loop(n: int) -> int:
    total = 0
    for i in range(n):
        total += _helper(i)  # a call: traced like the engine's hooks and helpers
    return total


def _helper(i: int) -> int:
    return i * 2


def test_count_opcodes_is_exact_and_grows_with_the_work():
    one, two, three = (count_opcodes(_loop, n) for n in (10, 20, 30))
    assert one > 0 and count_opcodes(_loop, 10) == one  # the same path, the same count
    assert two - one == three - two > 0  # every iteration (loop body and the called helper) alike
    assert count_opcodes(lambda: None) < one


def test_compute_timer_counts_every_operation():
    x = torch.randn(8, 8)
    timer = ComputeTimer()
    with timer:
        y = x @ x  # a kernel
        y.add_(1.0).mul_(2.0)  # two operations that are not kernels
    assert timer.calls == 1 and timer.ops == 3
