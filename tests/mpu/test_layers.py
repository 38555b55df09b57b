"""Column/row-parallel linear and vocab-parallel embedding against single-process torch.

For every TP size and option, forward outputs and the gradients of input,
weight and bias equal those of ``F.linear`` / ``F.embedding`` built from the
same full weights. The full weights come from seeding the default generator
the way the layers do, so the same assertions prove TP-invariant init.
"""

import itertools

import pytest
import torch
import torch.nn.functional as F

from megazero import mpu
from megazero.mpu.initializers import initialize_sharded_
from tests.distributed import run_distributed
from tests.helpers import assert_close, chunk, randn

S, B, IN, OUT, VOCAB = 8, 3, 12, 16, 40
INIT_SEED = 77


def _master(shape, partition_dim=0):
    """The weight a tp=1 layer draws after seeding (the counter-based N(0, 0.02) of initializers)."""
    torch.manual_seed(INIT_SEED)
    w = torch.empty(shape)
    initialize_sharded_(w, shape, partition_dim, 0, 1, mpu.init_method_normal(0.02))
    return w


def _check_column(tp, bias, gather_output, skip_bias_add, sequence_parallel):
    rank = mpu.get_tensor_model_parallel_rank()
    torch.manual_seed(INIT_SEED)
    layer = mpu.ColumnParallelLinear(IN, OUT, bias=bias, gather_output=gather_output, skip_bias_add=skip_bias_add,
                                     sequence_parallel=sequence_parallel)
    w_full, b_full = _master((OUT, IN)), randn(OUT, seed=5)
    assert layer.weight.shape == (OUT // tp, IN)
    assert_close(layer.weight.detach(), chunk(w_full, 0, rank, tp), "TP-invariant init of the column weight", atol=0, rtol=0)
    if bias:
        with torch.no_grad():
            layer.bias.copy_(chunk(b_full, 0, rank, tp))
    x_full = randn(S, B, IN, seed=1)
    g_full = randn(S, B, OUT, seed=2)
    x = (chunk(x_full, 0, rank, tp) if sequence_parallel and tp > 1 else x_full).clone().requires_grad_()
    out, out_bias = layer(x)
    assert (out_bias is not None) == (skip_bias_add and bias)
    if out_bias is not None:
        out = out + out_bias
    g = g_full if gather_output else chunk(g_full, -1, rank, tp)
    (out * g).sum().backward()

    xr = x_full.clone().requires_grad_()
    wr = w_full.clone().requires_grad_()
    br = b_full.clone().requires_grad_() if bias else None
    ref = F.linear(xr, wr, br)
    (ref * g_full).sum().backward()

    assert_close(out, ref if gather_output else chunk(ref, -1, rank, tp), "column output")
    assert_close(x.grad, chunk(xr.grad, 0, rank, tp) if sequence_parallel and tp > 1 else xr.grad, "column input grad")
    assert_close(layer.weight.grad, chunk(wr.grad, 0, rank, tp), "column weight grad")
    if bias:
        assert_close(layer.bias.grad, chunk(br.grad, 0, rank, tp), "column bias grad")
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0 and layer.weight.partition_stride == 1


def _check_row(tp, bias, input_is_parallel, skip_bias_add, sequence_parallel):
    rank = mpu.get_tensor_model_parallel_rank()
    torch.manual_seed(INIT_SEED)
    layer = mpu.RowParallelLinear(IN, OUT, bias=bias, input_is_parallel=input_is_parallel,
                                  skip_bias_add=skip_bias_add, sequence_parallel=sequence_parallel)
    w_full, b_full = _master((OUT, IN), partition_dim=1), randn(OUT, seed=5)
    assert layer.weight.shape == (OUT, IN // tp)
    assert_close(layer.weight.detach(), chunk(w_full, 1, rank, tp), "TP-invariant init of the row weight", atol=0, rtol=0)
    if bias:
        assert layer.bias.shape == (OUT,) and not layer.bias.tensor_model_parallel
        with torch.no_grad():
            layer.bias.copy_(b_full)
    x_full = randn(S, B, IN, seed=1)
    g_full = randn(S, B, OUT, seed=2)
    x = (chunk(x_full, -1, rank, tp) if input_is_parallel else x_full).clone().requires_grad_()
    out, out_bias = layer(x)
    assert (out_bias is not None) == (skip_bias_add and bias)
    if out_bias is not None:
        out = out + out_bias
    sp = sequence_parallel and tp > 1
    g = chunk(g_full, 0, rank, tp) if sp else g_full
    (out * g).sum().backward()

    xr = x_full.clone().requires_grad_()
    wr = w_full.clone().requires_grad_()
    br = b_full.clone().requires_grad_() if bias else None
    ref = F.linear(xr, wr, br)
    (ref * g_full).sum().backward()

    assert_close(out, chunk(ref, 0, rank, tp) if sp else ref, "row output")
    assert_close(x.grad, chunk(xr.grad, -1, rank, tp) if input_is_parallel else xr.grad, "row input grad")
    assert_close(layer.weight.grad, chunk(wr.grad, 1, rank, tp), "row weight grad")
    if bias:
        # Under sequence parallelism the full bias grad needs the TP all-reduce the layer adds.
        assert_close(layer.bias.grad, br.grad, "row bias grad")


COLUMN_CASES = [c for c in itertools.product([True, False], repeat=4) if not (c[3] and c[1])]  # SP needs gather_output=False
ROW_CASES = [c for c in itertools.product([True, False], repeat=4) if not (c[3] and not c[1])]  # SP needs input_is_parallel


def _all_linear_cases(tp):
    mpu.initialize_model_parallel(tp)
    for bias, gather_output, skip_bias_add, sp in COLUMN_CASES:
        _check_column(tp, bias, gather_output, skip_bias_add, sp)
    for bias, input_is_parallel, skip_bias_add, sp in ROW_CASES:
        _check_row(tp, bias, input_is_parallel, skip_bias_add, sp)
    return len(COLUMN_CASES) + len(ROW_CASES)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_linear_layers_match_torch(tp):
    # 4 ranks: tp=1 and tp=2 also run with dp>1, so DP peers must not interfere.
    assert run_distributed(4, _all_linear_cases, tp) == [len(COLUMN_CASES) + len(ROW_CASES)] * 4


def _embedding_case(tp):
    mpu.initialize_model_parallel(tp)
    rank = mpu.get_tensor_model_parallel_rank()
    torch.manual_seed(INIT_SEED)
    emb = mpu.VocabParallelEmbedding(VOCAB, IN)
    w_full = _master((VOCAB, IN))
    assert emb.weight.shape == (VOCAB // tp, IN)
    assert (emb.vocab_start_index, emb.vocab_end_index) == (rank * VOCAB // tp, (rank + 1) * VOCAB // tp)
    ids = torch.randint(0, VOCAB, (B, S), generator=torch.Generator().manual_seed(3))
    ids[0, :4] = torch.tensor([0, VOCAB - 1, VOCAB // 2, VOCAB // 2 - 1])  # shard borders
    g = randn(B, S, IN, seed=4)
    out = emb(ids)
    (out * g).sum().backward()
    wr = w_full.clone().requires_grad_()
    ref = F.embedding(ids, wr)
    (ref * g).sum().backward()
    assert_close(out, ref, "embedding output")
    assert_close(emb.weight.grad, chunk(wr.grad, 0, rank, tp), "embedding weight grad")


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_vocab_parallel_embedding_matches_torch(tp):
    run_distributed(4, _embedding_case, tp)


def _indivisible(tp):
    mpu.initialize_model_parallel(tp)
    msgs = []
    for build in (lambda: mpu.ColumnParallelLinear(IN, 6), lambda: mpu.RowParallelLinear(6, OUT),
                  lambda: mpu.VocabParallelEmbedding(42, IN)):
        try:
            build()
            msgs.append(None)
        except ValueError as e:
            msgs.append(str(e))
    return msgs


def test_sizes_not_divisible_by_tp_are_refused_with_the_numbers():
    msgs = run_distributed(4, _indivisible, 4)[0]
    assert "output_size (6)" in msgs[0] and "(4)" in msgs[0]
    assert "input_size (6)" in msgs[1]
    assert "42 is not divisible by 4" in msgs[2]


def test_meta_construction_allocates_nothing_and_resets_later():
    torch.manual_seed(INIT_SEED)
    layer = mpu.ColumnParallelLinear(IN, OUT, device="meta")
    assert layer.weight.is_meta
    layer.to_empty(device="cpu")
    torch.manual_seed(INIT_SEED)
    layer.reset_parameters()
    torch.testing.assert_close(layer.weight.detach(), _master((OUT, IN)), atol=0, rtol=0)


def test_single_process_without_distributed():
    # Layers work (tp=1, no communication) when torch.distributed is not running at all.
    layer = mpu.RowParallelLinear(IN, OUT)
    out, bias = layer(torch.ones(2, IN))
    assert out.shape == (2, OUT) and bias is None


def test_pad_vocab_size():
    assert mpu.pad_vocab_size(50257, 1) == 50304
    assert mpu.pad_vocab_size(50257, 4) == 50688
    assert mpu.pad_vocab_size(512, 4, make_vocab_size_divisible_by=128) == 512
