"""Host synchronisations per iteration, counted in the real run (``pretrain_gpt.py``'s main on 1-4 ranks).

Every tensor-to-Python conversion (``item``, ``tolist``, ``float``, ``int``, ``bool``, ``.cpu()``,
``.numpy()``) made by megazero's code stalls a GPU's run-ahead; on CPU it costs nothing, which is
why it hides. Each rank installs counters on ``torch.Tensor``, runs ``pretrain_gpt.py``'s ``main``
and returns the conversions made from megazero frames during each
iteration (from the previous step's end to this one's: the previous iteration's log, evaluation,
save and stop decisions, this one's data read, step and bookkeeping), heard through the loop's
callbacks. Not counted, since they never touch a device: torch's own optimizer reading its CPU step
counters, and datasets building host samples.

Object collectives (``broadcast_object_list`` and the like) are counted too. At every ZeRO stage,
pp 1 and 2, fp32 and fp16, with the optimizer offloaded or not, a non-logging iteration after the first makes one: the step's
all-reduce read on the host (the norm for clipping, the overflow flag, the data-read failure flags
and the ZeRO-2/3 forward agreement ride on it). The first iteration of ZeRO-2/3 agrees on each
forward (``megazero/zero/agreement.py``).
"""

from __future__ import annotations

import contextlib
import os

import pytest

from tests.distributed import run_distributed

_CONVERSIONS = ("item", "tolist", "__float__", "__int__", "__bool__", "cpu", "numpy")
_OBJECT_COLLECTIVES = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")


def _count_on_rank(argv: list[str]) -> list[dict]:
    """pretrain_gpt.py's main(argv) on this rank with counters installed; per iteration, the host
    conversions made from megazero frames (and object collectives) while reading data and stepping."""
    import collections
    import traceback
    from unittest import mock

    import torch
    import torch.distributed as dist

    from megazero.cli.pretrain_gpt import main
    from megazero.training.loop import Callback

    counts, active, per_iteration = collections.Counter(), [False], []

    def counted(name):
        orig = getattr(torch.Tensor, name)

        def f(self, *a, **k):
            if active[0]:
                frames = [fr for fr in traceback.extract_stack()[:-1]
                          if "/megazero/" in fr.filename or "/torch/optim/" in fr.filename]
                # Datasets build host (numpy) samples: their conversions never touch a device.
                if frames and "/megazero/" in frames[-1].filename and frames[-1].name != "__getitem__":
                    counts[f"{name}@{os.path.basename(frames[-1].filename)}:{frames[-1].name}"] += 1
            return orig(self, *a, **k)
        return f

    def object_collective(name):
        orig = getattr(dist, name)

        def f(*a, **k):
            if active[0]:
                counts[f"{name}@object collective"] += 1
            return orig(*a, **k)
        return f

    class Window(Callback):
        """Counts from the first step's start (then each step's end) to the next step's end."""

        def on_train_start(self, state, run):
            active[0] = True

        def on_step_end(self, state, result):
            per_iteration.append(dict(counts))
            counts.clear()

    with contextlib.ExitStack() as patches:
        for n in _CONVERSIONS:
            patches.enter_context(mock.patch.object(torch.Tensor, n, counted(n)))
        for n in _OBJECT_COLLECTIVES:
            patches.enter_context(mock.patch.object(dist, n, object_collective(n)))
        try:
            assert main(argv, callbacks=[Window()]) == 0
        finally:
            active[0] = False
    return per_iteration


def _flags(*extra: str) -> list[str]:
    return ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--train-iters", "4", "--lr", "1e-3", "--mock-data", "--vocab-size", "64", "--log-interval", "100",
            "--eval-iters", "0", "--clip-grad", "1.0", *extra]


def _count(world: int, *extra: str) -> list[dict]:
    """Each rank's counts of a ``world``-rank run (pretrain_gpt.py's main on the test pool's ranks)."""
    out = run_distributed(world, _count_on_rank, _flags(*extra))
    return [{"rank": rank, "iterations": its} for rank, its in enumerate(out)]


@pytest.mark.parametrize("world,extra", [
    (1, ["--zero-stage", "1"]),
    (2, ["--zero-stage", "3"]),
    (2, ["--zero-stage", "1", "--pp", "2"]),
    (4, ["--zero-stage", "2", "--pp", "2", "--fp16"]),
    # The offloaded step (host AdamW, streamed in chunks) adds no host synchronisation of its own.
    (2, ["--zero-stage", "3", "--optimizer-cpu-offload"]),
])
def test_one_host_sync_per_iteration(tmp_path, world, extra):
    for r in _count(world, *extra):
        # The first iteration agrees on the forwards (ZeRO-2/3); the last logs (it flushes the
        # losses). The ones between must not wait for the device but once: the step's all-reduce
        # (norm, fp16 overflow, failure flags, forward agreement), read for clipping (Megatron reads
        # the norm and the overflow flag apart: two).
        steady = r["iterations"][1:-1]
        assert steady, r
        for it in steady:
            assert sum(it.values()) == 1, (r["rank"], it)  # the counters are live: the step's read is seen
            assert all(k.startswith("tolist@engine.py:_step_sums") for k in it), it


MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--swiglu", "--moe-aux-loss-coeff",
       "0.01", "--moe-expert-capacity-factor", "1.0"]


@pytest.mark.parametrize("world,extra", [
    (2, ["--zero-stage", "1", "--expert-model-parallel-size", "2"]),
    (4, ["--zero-stage", "3", "--expert-model-parallel-size", "2", "--tp", "2", "--sequence-parallel",
         "--expert-tensor-parallel-size", "1", "--moe-grouped-gemm"]),
])
def test_mixture_of_experts_padded_to_capacity_waits_once_per_iteration(tmp_path, world, extra):
    # Padded to capacity, every all-to-all's sizes are known on the host: the step's read stays the only one.
    for r in _count(world, *MOE, "--moe-pad-expert-input-to-capacity", *extra):
        for it in r["iterations"][1:-1]:
            assert it == {"tolist@engine.py:_step_sums": 1}, (r["rank"], it)


def test_dropless_mixture_of_experts_reads_its_all_to_all_sizes_once_per_layer_and_micro_batch(tmp_path):
    # Without padding the expert rows a rank receives are read on the host (Megatron's alltoall dispatcher
    # does the same): 4 layers x 4 micro-batches per rank and iteration, besides the step's read.
    for r in _count(2, *MOE, "--expert-model-parallel-size", "2"):
        for it in r["iterations"][1:-1]:
            assert it == {"tolist@engine.py:_step_sums": 1, "tolist@dispatch.py:dispatch": 16}, (r["rank"], it)
