"""The planner's pipeline terms: per-stage parameters, activations in flight, bubble, p2p bytes."""

import pytest

from megazero.model.config import gpt_preset
from megazero.model.flops import num_parameters
from megazero.observe.planner import activation_bytes_per_layer, estimate_memory, replicated_parameters


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
    # per micro-batch in flight: its layers' activations, the output it sent (kept for backward) and
    # the embedding's dropout mask
    d = est.activation_detail
    assert first["activations"] == pytest.approx(4 * ((cfg.num_layers // 4) * per_layer + d["layer_input"]
                                                      + d["embedding_mask"]))
    assert est.pipeline["bubble"] == pytest.approx(3 / 16)
    _, few = _plan(pp=4, m=2)
    assert [s["in_flight"] for s in few.pipeline["stages"]] == [2, 2, 2, 1]


def test_interleaved_first_stage_holds_L_times_1_plus_pp_minus_1_over_pp_v_layers():
    cfg, est = _plan(pp=4, v=3, m=16)
    per_layer = activation_bytes_per_layer(cfg, micro_batch_size=2, seq_length=cfg.seq_length, tp=2)
    L, pp, v = cfg.num_layers, 4, 3
    d = est.activation_detail
    chunks_in_flight = (pp - 1) * 2 + (v - 1) * pp + 1  # each holds L / (pp v) layers: L (1 + (pp-1)/(pp v)) in all
    assert chunks_in_flight * (L // (pp * v)) == L * (1 + (pp - 1) / (pp * v))
    assert est.pipeline["stages"][0]["activations"] == pytest.approx(
        L * (1 + (pp - 1) / (pp * v)) * per_layer + chunks_in_flight * d["layer_input"] + pp * d["embedding_mask"])
    assert est.pipeline["bubble"] == pytest.approx(3 / (3 * 16))


def test_p2p_bytes_per_step():
    cfg, est = _plan(pp=2, v=2, m=8)
    boundary = 2 * cfg.seq_length * 2 * cfg.hidden_size  # bf16 [s, b, h]
    assert est.pipeline["p2p_bytes_per_step"] == 2 * 8 * 2 * boundary
    _, sp = _plan(pp=2, v=2, m=8, sequence_parallel=True)
    assert sp.pipeline["p2p_bytes_per_step"] == est.pipeline["p2p_bytes_per_step"] / 2  # shards, tp 2


def test_layers_must_divide_unless_the_end_stages_are_set():
    with pytest.raises(ValueError, match=r"num_layers \(12\) is not divisible by the pipeline size \(5\)"):
        _plan(pp=5)
    with pytest.raises(ValueError, match=r"leaves 8 layers for the 3 other stage"):
        _plan(pp=5, first_stage_layers=3, last_stage_layers=1)


def test_an_uneven_split_plans_each_stage_with_its_own_layers():
    from megazero.model.pipeline_split import stage_num_layers

    cfg, even = _plan(pp=4)
    _, uneven = _plan(pp=5, first_stage_layers=2, last_stage_layers=1)  # 2 + 3 x 3 + 1 of the 12 layers
    stages = uneven.pipeline["stages"]
    assert [s["layers"] for s in stages] == stage_num_layers(12, 5, 2, 1) == [2, 3, 3, 3, 1]
    assert [s["layer_ranges"] for s in stages] == [[(0, 2)], [(2, 5)], [(5, 8)], [(8, 11)], [(11, 12)]]
    assert sum(s["params"] for s in stages) == pytest.approx(sum(s["params"] for s in even.pipeline["stages"]))
    assert stages[1]["params"] == stages[2]["params"] == stages[3]["params"]
    layer = even.pipeline["stages"][1]["params"] / 3  # a middle stage of the even split: 3 layers, nothing else
    assert stages[0]["params"] == pytest.approx(even.pipeline["stages"][0]["params"] - layer)  # 2 layers + embedding
    assert stages[1]["params"] == pytest.approx(3 * layer)
    assert "largest stage: 1 (3 layers" in uneven.to_text()


def test_the_largest_stage_of_a_dense_first_pattern_holds_experts():
    """DeepSeek-V3's pattern (the first layers dense) at an uneven split: the dense first stage holds no
    experts; the stage the plan reports, with its experts counted, is the largest."""
    cfg = gpt_preset("125m").replace(num_experts=8, moe_router_topk=2, moe_layer_freq=(0,) * 3 + (1,) * 9)
    est = estimate_memory(cfg, tp=2, dp=4, pp=4, zero_stage=1, micro_batch_size=1, expert_parallel=4,
                          global_batch_size=32, first_stage_layers=3, last_stage_layers=1)
    stages = est.pipeline["stages"]
    assert [(s["layers"], s["moe_layers"]) for s in stages] == [(3, 0), (4, 4), (4, 4), (1, 1)]
    assert stages[0]["expert_params"] == 0 and stages[1]["expert_params"] == 4 * stages[3]["expert_params"] > 0
    worst = max(stages, key=lambda s: s["total"])
    assert est.pipeline["worst_stage"] == worst["stage"] == 1 and est.total == pytest.approx(worst["total"])
    assert stages[0]["traffic"]["ep"] == 0 < stages[3]["traffic"]["ep"] == stages[1]["traffic"]["ep"] / 4


def test_13b_script_compares_the_megatron_deepspeed_layout():
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, NNODES="4", DRY_RUN="1", LAYOUT="tp4pp8z1", REHEARSE="0")
    r = subprocess.run(["bash", str(root / "examples" / "azure" / "run_gpt_13b.sh")], env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "world 32 = tp 4 x pp 8 x dp 1, ZeRO stage 1" in r.stdout
    assert "stage 0: layers 0-4 (embedding)" in r.stdout and "stage 7: layers 35-39 (head)" in r.stdout
    table = r.stdout[r.stdout.index("layouts compared"):]
    assert "tp4z3" in table and "tp4pp8z1" in table
    bubble = [line for line in table.splitlines() if "pipeline bubble" in line][0].split()
    assert bubble[-2:] == ["0.000", f"{7 / 512:.3f}"]
    env["LAYOUT"] = "tp4pp4"
    bad = subprocess.run(["bash", str(root / "examples" / "azure" / "run_gpt_13b.sh")], env=env, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "LAYOUT must be tp4z3 or tp4pp8z1" in bad.stderr
