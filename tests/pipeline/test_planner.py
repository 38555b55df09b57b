"""The planner's pipeline terms: per-stage parameters, activations in flight, bubble, p2p bytes."""

import pytest

from megazero.model.config import gpt_preset
from megazero.model.flops import num_parameters
from megazero.training.memory import activation_bytes_per_layer, estimate_memory, replicated_parameters


def _plan(pp, v=1, m=16, tp=2, **kw):
    cfg = gpt_preset("125m")
    return cfg, estimate_memory(cfg, tp=tp, dp=2, pp=pp, zero_stage=1, micro_batch_size=2, precision="bf16",
                                global_batch_size=2 * 2 * m, virtual_pp=v, **kw)


def test_stages_partition_the_model_plus_the_tied_copy():
    cfg, est = _plan(pp=4)
    stages = est.pipeline["stages"]
    total_tp = (num_parameters(cfg) - replicated_parameters(cfg)) / 2 + replicated_parameters(cfg)
    tied_copy = cfg.padded_vocab_size * cfg.hidden_size / 2
    assert sum(s["params"] for s in stages) == pytest.approx(total_tp + tied_copy)
    assert stages[0]["params"] > stages[1]["params"] == stages[2]["params"] < stages[3]["params"]


def test_1f1b_in_flight_and_bubble():
    cfg, est = _plan(pp=4, m=16)
    assert [s["in_flight"] for s in est.pipeline["stages"]] == [4, 3, 2, 1]
    per_layer = activation_bytes_per_layer(cfg, micro_batch_size=2, seq_length=cfg.seq_length, tp=2)
    first = est.pipeline["stages"][0]
    assert first["activations"] == pytest.approx(4 * (cfg.num_layers // 4) * per_layer)
    assert est.pipeline["bubble"] == pytest.approx(3 / 16)
    _, few = _plan(pp=4, m=2)
    assert [s["in_flight"] for s in few.pipeline["stages"]] == [2, 2, 2, 1]


def test_interleaved_first_stage_holds_L_times_1_plus_pp_minus_1_over_pp_v_layers():
    cfg, est = _plan(pp=4, v=3, m=16)
    per_layer = activation_bytes_per_layer(cfg, micro_batch_size=2, seq_length=cfg.seq_length, tp=2)
    L, pp, v = cfg.num_layers, 4, 3
    assert est.pipeline["stages"][0]["activations"] == pytest.approx(L * (1 + (pp - 1) / (pp * v)) * per_layer)
    assert est.pipeline["bubble"] == pytest.approx(3 / (3 * 16))


def test_p2p_bytes_per_step():
    cfg, est = _plan(pp=2, v=2, m=8)
    boundary = 2 * cfg.seq_length * 2 * cfg.hidden_size  # bf16 [s, b, h]
    assert est.pipeline["p2p_bytes_per_step"] == 2 * 8 * 2 * boundary
    _, sp = _plan(pp=2, v=2, m=8, sequence_parallel=True)
    assert sp.pipeline["p2p_bytes_per_step"] == est.pipeline["p2p_bytes_per_step"] / 2  # shards, tp 2


def test_layers_must_divide():
    with pytest.raises(ValueError, match=r"num_layers \(12\) is not divisible by pp \(5\)"):
        _plan(pp=5)
