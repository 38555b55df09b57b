"""bench_zero's split of a step's CPU time: the model's matmul/attention kernels vs the rest."""

import time

import torch
import torch.nn.functional as F

from benchmarks.zero_baselines import ComputeTimer


def test_compute_timer_counts_the_kernels_of_forward_and_backward_and_nothing_else():
    torch.manual_seed(0)
    x = torch.randn(256, 128, requires_grad=True)
    w = torch.randn(512, 128, requires_grad=True)
    q = torch.randn(1, 2, 64, 32, requires_grad=True)
    timer = ComputeTimer()
    with timer:
        y = F.linear(x, w)  # one mm forward, two in backward (input and weight gradients)
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        (y.square().sum() + a.sum()).backward()
        for _ in range(50):  # elementwise work: not counted
            y.detach().mul(2.0).add_(1.0)
    assert timer.seconds["matmul"] > 0 and timer.seconds["attention"] > 0
    assert timer.calls >= 5  # 3 matmuls, the attention forward and its backward
    # Only kernels are timed: a loop of elementwise ops adds nothing.
    before = dict(timer.seconds)
    with timer:
        t0 = time.thread_time()
        for _ in range(200):
            x.detach().mul(2.0).add_(1.0)
        spent = time.thread_time() - t0
    assert spent > 0 and timer.seconds == before
