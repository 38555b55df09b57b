"""GPTModel at tp in {1, 2, 4} against a single-process tp=1 reference (4 ranks, so
tp=1 and tp=2 also run with dp>1, which must not matter).

Same seed => identical gathered weights (TP-invariant init); same per-token loss and
same gathered gradients, with sequence parallelism off and on (the norm weights see
only a sequence shard: their grads need the TP all-reduce), with every recompute
mode, and with the math attention backend.
"""

import pytest
import torch

from megazero import mpu
from megazero.model import GPTModel
from megazero.model.state_dict import gather_full_state_dict, gather_full_tensor, load_full_state_dict
from tests.distributed import run_distributed
from tests.helpers import assert_close
from tests.model.common import batch, mean_loss, tiny_config

SEED = 1234

CASES = [  # GPTConfig overrides on top of the tiny config
    dict(),
    dict(sequence_parallel=True),
    dict(sequence_parallel=True, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    dict(sequence_parallel=True, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=2),
    dict(sequence_parallel=True, recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
    dict(sequence_parallel=True, recompute_granularity="selective"),
    dict(attention_backend="math", recompute_granularity="selective"),
]


def _run(model, ids, labels):
    loss = model(ids, labels=labels)
    mean_loss(loss, labels).backward()
    grads = {n: gather_full_tensor(p.grad, p, model.tp_group) for n, p in model.named_parameters()}
    return loss.detach(), grads


def _parity(tp, arch):
    config = tiny_config(arch)
    ids, labels = batch(config)
    # Reference first, before any model-parallel group exists: plain single-process tp=1.
    torch.manual_seed(SEED)
    ref = GPTModel(config)
    ref_weights = gather_full_state_dict(ref)
    ref_loss, ref_grads = _run(ref, ids, labels)

    mpu.initialize_model_parallel(tp)
    diffs = {"loss": 0.0, "grad": 0.0}
    for case in CASES:
        torch.manual_seed(SEED)
        model = GPTModel(config.replace(**case))
        assert model.tp_size == tp
        weights = gather_full_state_dict(model)
        assert weights.keys() == ref_weights.keys()
        for k, w in weights.items():
            assert_close(w, ref_weights[k], f"init of {k} at tp={tp}", atol=0, rtol=0)
        loss, grads = _run(model, ids, labels)
        diffs["loss"] = max(diffs["loss"], assert_close(loss, ref_loss, f"loss at tp={tp} {case}"))
        for k, g in grads.items():
            diffs["grad"] = max(diffs["grad"], assert_close(g, ref_grads[k], f"grad of {k} at tp={tp} {case}"))
        if case.get("sequence_parallel") and tp > 1:
            assert model.layers[0].input_layernorm.weight.sequence_parallel
    return diffs


@pytest.mark.parametrize("arch", ["gpt", "llama"])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tp_matches_single_process(tp, arch):
    diffs = run_distributed(4, _parity, tp, arch)
    assert diffs[0]["grad"] < 1e-5


def _swiglu_chunks(tp):
    mpu.initialize_model_parallel(tp)
    config = tiny_config("llama")
    torch.manual_seed(SEED)
    model = GPTModel(config)
    fc1 = model.layers[0].mlp.linear_fc1
    full = gather_full_state_dict(model)["layers.0.mlp.linear_fc1.weight"]
    gate, up = full.chunk(2)
    rank = mpu.get_tensor_model_parallel_rank()
    expected = torch.cat([gate.chunk(tp)[rank], up.chunk(tp)[rank]])
    assert fc1.weight.partition_stride == 2
    assert torch.equal(fc1.weight.detach(), expected)
    # Each rank's QKV chunk holds whole query groups: [q of its heads; k; v] per group.
    qkv = model.layers[0].self_attention.linear_qkv.weight
    groups_per_rank = config.query_groups // tp
    assert qkv.shape[0] == groups_per_rank * (config.num_attention_heads // config.query_groups + 2) * config.head_dim


def test_swiglu_and_qkv_shards_hold_their_own_slices():
    run_distributed(4, _swiglu_chunks, 2)
    run_distributed(4, _swiglu_chunks, 4)


def _dropout_determinism(tp):
    mpu.initialize_model_parallel(tp)
    out = {}
    nodrop = tiny_config("gpt")
    drop = nodrop.replace(hidden_dropout=0.1, attention_dropout=0.1)
    ids, labels = batch(drop)
    for name, config in [("nodrop", nodrop), ("drop", drop), ("drop_again", drop),
                         ("drop_sp", drop.replace(sequence_parallel=True)),
                         ("drop_sp_full", drop.replace(sequence_parallel=True, recompute_granularity="full")),
                         ("drop_sp_selective", drop.replace(sequence_parallel=True, recompute_granularity="selective")),
                         ("drop_math", drop.replace(attention_backend="math")),
                         ("drop_math_selective", drop.replace(attention_backend="math", recompute_granularity="selective"))]:
        mpu.model_parallel_manual_seed(SEED)
        model = GPTModel(config)
        out[name] = _run(model, ids, labels)
    loss0 = mean_loss(out["nodrop"][0], labels)
    for name, (loss, _) in out.items():
        assert torch.isfinite(loss).all(), name
        assert abs(float(mean_loss(loss, labels)) - float(loss0)) < 0.5, name
    assert not torch.equal(out["drop"][0], out["nodrop"][0]), "dropout had no effect"

    def same(a, b):
        assert torch.equal(out[a][0], out[b][0]), (a, b)
        for k in out[a][1]:
            assert torch.equal(out[a][1][k], out[b][1][k]), (a, b, k)

    same("drop", "drop_again")  # deterministic for a fixed seed
    same("drop_sp", "drop_sp_full")  # recomputation replays both RNG streams exactly
    same("drop_sp", "drop_sp_selective")
    same("drop_math", "drop_math_selective")
    return float(mean_loss(out["drop"][0], labels))


def test_dropout_is_deterministic_and_recompute_replays_it():
    losses = run_distributed(4, _dropout_determinism, 2)
    assert losses[0] == losses[2]  # the two DP replicas (same data) agree


def _reshard():
    losses = []
    full = None
    for tp in (4, 2):
        mpu.initialize_model_parallel(tp)
        config = tiny_config("llama", sequence_parallel=True)
        torch.manual_seed(SEED + tp)  # different init: only the loaded weights may matter
        model = GPTModel(config)
        if full is None:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01)  # leave the init, so this is not just TP-invariant init again
            full = gather_full_state_dict(model)
        else:
            load_full_state_dict(model, full)
            gathered = gather_full_state_dict(model)
            assert all(torch.equal(gathered[k], full[k]) for k in full)
        ids, labels = batch(config)
        losses.append(model(ids, labels=labels).detach())
        mpu.destroy_model_parallel()
    assert_close(losses[1], losses[0], "loss after resharding tp=4 -> tp=2")


def test_checkpoint_reshards_across_tp_sizes():
    run_distributed(4, _reshard)
