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


# ---- sequence parallelism: the column-parallel layer saves the shard, not the gathered input -----


def _sp_layer(tp, rank, w_full, b_full, **kw):
    layer = mpu.ColumnParallelLinear(IN, OUT, gather_output=False, sequence_parallel=True, **kw)
    with torch.no_grad():
        if layer.weight is not None:
            layer.weight.copy_(chunk(w_full, 0, rank, tp))
        if layer.bias is not None:
            layer.bias.copy_(chunk(b_full, 0, rank, tp))
    return layer


def _sp_column_case(tp):
    mpu.initialize_model_parallel(tp)
    rank, group = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_group()
    w_full, b_full = randn(OUT, IN, seed=8), randn(OUT, seed=9)
    x_full, g_full = randn(S, B, IN, seed=1), randn(S, B, OUT, seed=2)
    g = chunk(g_full, -1, rank, tp)
    x_shard = lambda: chunk(x_full, 0, rank, tp).clone().requires_grad_()  # noqa: E731

    xr, wr, br = x_full.clone().requires_grad_(), w_full.clone().requires_grad_(), b_full.clone().requires_grad_()
    ref = F.linear(xr, wr, br)
    (ref * g_full).sum().backward()
    ref_out, ref_x, ref_w, ref_b = (chunk(ref, -1, rank, tp), chunk(xr.grad, 0, rank, tp), chunk(wr.grad, 0, rank, tp),
                                    chunk(br.grad, 0, rank, tp))
    diffs = {}

    # The layer against single-process F.linear and against the previous implementation
    # (all-gather with autograd, then F.linear), which saved the gathered input.
    layer, x = _sp_layer(tp, rank, w_full, b_full), x_shard()
    out, _ = layer(x)
    (out * g).sum().backward()
    w_old, b_old, x_old = (layer.weight.detach().clone().requires_grad_(), layer.bias.detach().clone().requires_grad_(),
                           x_shard())
    out_old = F.linear(mpu.gather_from_sequence_parallel_region(x_old, group, True), w_old, b_old)
    (out_old * g).sum().backward()
    for name, new, old, want in (("out", out, out_old, ref_out), ("x grad", x.grad, x_old.grad, ref_x),
                                 ("w grad", layer.weight.grad, w_old.grad, ref_w), ("b grad", layer.bias.grad, b_old.grad, ref_b)):
        diffs[f"{name} vs previous"] = assert_close(new, old, f"{name} vs previous implementation", atol=1e-6, rtol=1e-6)
        diffs[f"{name} vs F.linear"] = assert_close(new, want, f"{name} vs F.linear")

    # Tied output layer: the weight is handed to forward (a parameter of another module).
    tied = _sp_layer(tp, rank, w_full, b_full, bias=False, skip_weight_param_allocation=True)
    weight, x = torch.nn.Parameter(chunk(w_full, 0, rank, tp)), x_shard()
    out, _ = tied(x, weight=weight)
    (out * g).sum().backward()
    ref_nb = F.linear(x_full, w_full)
    diffs["tied out"] = assert_close(out, chunk(ref_nb, -1, rank, tp), "tied output")
    diffs["tied x grad"] = assert_close(x.grad, ref_x, "tied input grad")
    diffs["tied w grad"] = assert_close(weight.grad, ref_w, "tied weight grad")

    # Frozen weight: no weight gradient (None, not zeros); input and bias gradients unchanged.
    frozen, x = _sp_layer(tp, rank, w_full, b_full), x_shard()
    frozen.weight.requires_grad_(False)
    out, _ = frozen(x)
    (out * g).sum().backward()
    assert frozen.weight.grad is None
    assert_close(x.grad, ref_x, "frozen-weight input grad")
    assert_close(frozen.bias.grad, ref_b, "frozen-weight bias grad")

    # Input without grad (first layer of a frozen trunk): weight gradient only.
    layer2 = _sp_layer(tp, rank, w_full, b_full)
    x = chunk(x_full, 0, rank, tp)
    out, _ = layer2(x)
    (out * g).sum().backward()
    assert_close(layer2.weight.grad, ref_w, "weight grad with a no-grad input")

    with torch.no_grad():  # inference: plain gather + linear
        out, _ = layer(chunk(x_full, 0, rank, tp))
    assert_close(out, ref_out, "no-grad output")
    return {k: v for k, v in diffs.items()}


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_column_linear_gradients(tp):
    for d in run_distributed(4, _sp_column_case, tp):
        assert max(d.values()) < 1e-5, d


def _sp_memory_case(tp, legacy):
    from megazero.utils import LiveMemoryTracker

    mpu.initialize_model_parallel(tp)
    rank, group = mpu.get_tensor_model_parallel_rank(), mpu.get_tensor_model_parallel_group()
    layer = _sp_layer(tp, rank, randn(OUT, IN, seed=8), randn(OUT, seed=9))
    x = chunk(randn(S, B, IN, seed=1), 0, rank, tp).clone().requires_grad_()  # own storage, not x_full's
    saved = []

    def pack(t):
        # The weight (or a transposed view of it) is a parameter, not an activation.
        if t.untyped_storage()._cdata != layer.weight.untyped_storage()._cdata:
            saved.append(t.untyped_storage().nbytes())
        return t

    with LiveMemoryTracker() as tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            if legacy:
                out = F.linear(mpu.gather_from_sequence_parallel_region(x, group, True), layer.weight, layer.bias)
            else:
                out, _ = layer(x)
        after_forward = tracker.mark("after_forward", settle=True)
        out.sum().backward()
        del out
        after_backward = tracker.mark("after_backward", settle=True)
    shard, gathered = S // tp * B * IN * 4, S * B * IN * 4
    out_bytes = S * B * (OUT // tp) * 4
    grads = (OUT // tp * IN + OUT // tp) * 4 + shard  # weight, bias, input
    return dict(saved=sum(saved), after_forward=after_forward.current_bytes, forward_peak=after_forward.peak_bytes,
                after_backward=after_backward.current_bytes, shard=shard, gathered=gathered, out=out_bytes, grads=grads)


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_parallel_column_linear_saves_only_the_shard(tp):
    for m in run_distributed(4, _sp_memory_case, tp, False):
        assert m["saved"] == m["shard"], m  # s/tp * b * h * 4 bytes
        assert m["after_forward"] == m["out"], m  # nothing but the output survives forward
        assert m["forward_peak"] == m["out"] + m["gathered"], m  # the gathered input was a temporary
        assert m["after_backward"] == m["grads"], m
    for m in run_distributed(4, _sp_memory_case, tp, True):  # what the previous implementation kept
        assert m["saved"] == m["gathered"] and m["after_forward"] == m["out"] + m["gathered"], m
