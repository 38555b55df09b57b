"""The layout planner: its search against brute force, its terms, the published record, bad input."""

from __future__ import annotations

import json
import random
from dataclasses import replace

import pytest

from megazero.cli import plan as plan_cli
from megazero.cli.planning import plan_config
from megazero.observe.plan_devices import Cluster, device_preset
from megazero.observe.plan_record import (KORTHIKANTI_2022, NARAYANAN_2021, calibrated_gemm_efficiency, row_plan,
                                          row_search)
from megazero.observe.plan_search import (Restrictions, _divisors, _families, evaluate, layout_args, search,
                                          uneven_split)
from megazero.observe.plan_time import GEMM_EFFICIENCY, TIME_TERMS, Layout
from megazero.observe.planner import GiB, plan_of
from megazero.training.arguments import parse_args


def _model(layers: int, heads: int, hidden: int, seq: int, gbs: int, *extra: str):
    words = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
             "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--vocab-size", "1000", "--bf16",
             "--global-batch-size", str(gbs), *extra]
    config = parse_args(words, 1, check_files=False, planning=True)
    return words, config, plan_of(config)


def _brute_force(config, cluster, base, gbs, keep_all: bool = False):
    """Every layout of every valid family, no pruning: (the fastest that fits, how many fit); with
    ``keep_all`` (every plan, how many)."""
    best, fitting, L, every = None, 0, config.num_layers, []
    for (tp, cp, pp, ep, etp), why in _families(config, cluster, Restrictions(), gbs):
        if why:
            continue
        dp = cluster.world // (tp * cp * pp)
        ends = uneven_split(L, pp) if L % pp else None
        for vpp in ([v for v in _divisors(L // pp)] if pp > 1 and not ends else [1]):
            for zero in (0, 1, 2, 3):
                for sp in (False, True):
                    for rc in (None, "selective", "full"):
                        for b in _divisors(gbs // dp):
                            for offload in (False, True):
                                m = gbs // (b * dp)
                                if (sp and tp == 1) or (vpp > 1 and m % pp) or (offload and not zero) or \
                                        (not sp and tp > 1 and etp not in (None, tp)):
                                    continue
                                lay = Layout(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, etp=etp, vpp=vpp, zero_stage=zero,
                                             sequence_parallel=sp, recompute=rc, micro_batch_size=b,
                                             offload_optimizer=offload,
                                             first_stage_layers=ends[0] if ends else None,
                                             last_stage_layers=ends[1] if ends else None)
                                plan = evaluate(config, lay, cluster, base, global_batch_size=gbs, precision="bf16",
                                                optimizer="adamw")
                                every.append(plan)
                                if plan.shortfall <= 0:
                                    fitting += 1
                                    if best is None or plan.step_time_s < best.step_time_s:
                                        best = plan
    return (every, len(every)) if keep_all else (best, fitting)


@pytest.mark.parametrize("seed", range(5))
def test_search_picks_what_brute_force_picks(seed):
    rng = random.Random(seed)
    heads = rng.choice([4, 8])
    layers = rng.choice([4, 6, 7])
    moe = ["--num-experts", "4", "--moe-router-topk", "2"] if seed % 2 else []
    world = rng.choice([4, 8])
    words, config, base = _model(layers, heads, 32 * heads, rng.choice([1024, 2048]), 16, *moe)
    # a device on which about half the layouts fit
    roomy = Cluster(world, 4, device_preset("h100-80gb"), reserve_gib=0.0)
    everything, _ = _brute_force(config.model, roomy, base, 16, keep_all=True)
    median = sorted(p.memory.device_total for p in everything)[len(everything) // 2]
    cluster = replace(roomy, device=device_preset("h100-80gb", memory_gib=median / GiB))
    found = search(config.model, cluster, base, global_batch_size=16, precision="bf16")
    best, fitting = _brute_force(config.model, cluster, base, 16)
    assert best is not None and found.plans, "the case should have fitting layouts"
    assert 0 < fitting < len(everything)
    assert found.plans[0].step_time_s == pytest.approx(best.step_time_s, rel=1e-12), (found.plans[0].layout,
                                                                                     best.layout)
    assert [p.step_time_s for p in found.plans] == sorted(p.step_time_s for p in found.plans)


def test_time_and_memory_terms_sum_and_json_plans_launch(tmp_path, capsys):
    out = tmp_path / "plans.json"
    words, _, _ = _model(4, 4, 128, 1024, 32)
    rc = plan_cli.main(["--world-size", "8", "--gpus-per-node", "4", "--gpu", "a100-80gb", "--device-memory-gb",
                        "1", "--memory-reserve-gb", "0", "--json", str(out), "--top", "6", *words])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads(out.read_text())
    plans = doc["plans"]
    assert plans and [p["step_time_s"] for p in plans] == sorted(p["step_time_s"] for p in plans)
    for p in plans:
        assert set(p["time_terms"]) == set(TIME_TERMS)
        assert sum(p["time_terms"].values()) == pytest.approx(p["step_time_s"], rel=1e-12)
        assert sum(p["memory_terms"].values()) == pytest.approx(p["peak_bytes_with_nccl"], rel=1e-12)
        assert p["peak_bytes"] == max(p["stage_peak_bytes"]) and len(p["stage_peak_bytes"]) == p["pp"]
        assert p["dp"] == 8 // (p["tp"] * p["pp"] * p["cp"]) and p["fits"]
        assert p["peak_bytes_with_nccl"] <= 1 * GiB
        cfg = plan_config(p["args"], 8, plan_cli.build_parser())  # the flags launch that layout
        par = cfg.parallel
        assert (par.tp, par.pp, par.dp, par.cp, par.zero_stage, cfg.schedule.micro_batch_size, par.virtual_pp) == \
               (p["tp"], p["pp"], p["dp"], p["cp"], p["zero_stage"], p["micro_batch_size"], p["vpp"])
        assert (cfg.model.recompute_granularity or "none") == p["recompute"]
    assert doc["rejected"] and all(r["reason"] for r in doc["rejected"])
    text = capsys.readouterr().out
    assert "chosen:" in text and "launch: torchrun" in text and "the other families" in text


def test_tflops_count_narayanan_and_mfu_the_causal_half():
    row = NARAYANAN_2021[0]
    full, none = row_plan(row), row_plan(row, recompute=None)
    # 96 B s L h^2 (1 + s/6h + V/16Lh) with full recompute, 72 B s L h^2 (1 + s/6h + V/12Lh) without
    B, s, L, h, V = row.batch, 2048, row.layers, row.hidden, 51200
    assert full.flops == pytest.approx(96 * B * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h)), rel=1e-12)
    assert none.flops == pytest.approx(72 * B * s * L * h * h * (1 + s / (6 * h) + V / (12 * L * h)), rel=1e-12)
    assert none.model_flops == pytest.approx(none.flops - 3 * B * s * L * 2 * s * h, rel=1e-12)


def test_the_calibrated_constant_is_the_one_in_the_code():
    assert calibrated_gemm_efficiency() == pytest.approx(GEMM_EFFICIENCY, abs=0.002)


def test_narayanan_table_1_layouts_and_throughput():
    """Restricted to 2021's features, the published (tp, pp) is among the three fastest families for at least
    8 of the 10 rows, and the published layout's predicted TFLOP/s per GPU is within 15 % on every row."""
    in_top3 = 0
    for row in NARAYANAN_2021:
        assert row_plan(row).tflops_per_gpu == pytest.approx(row.tflops, rel=0.15), row.name
        ranked = [(f.key[0], f.key[2]) for f in row_search(row).families if f.best]
        in_top3 += (row.tp, row.pp) in ranked[:3]
    assert in_top3 >= 8


def test_korthikanti_table_5_step_times_out_of_sample():
    errors = []
    for row in KORTHIKANTI_2022:
        for plan, measured in ((row_plan(row), row.step_full_s),
                               (row_plan(row, recompute="selective", sequence_parallel=True), row.step_selective_s)):
            errors.append(plan.step_time_s / measured - 1)
    assert max(map(abs, errors)) < 0.10 and sum(map(abs, errors)) / len(errors) < 0.05, errors


def test_groups_land_on_nvlink_or_the_network():
    c = Cluster(64, 8, device_preset("h100-80gb"))
    nvlink, net = 360e9, 45e9
    assert c.bandwidth("tp", tp=8, pp=1) == nvlink and c.bandwidth("dp", tp=8, pp=1) == net
    assert c.bandwidth("cp", tp=2, pp=1, cp=4) == nvlink and c.bandwidth("cp", tp=4, pp=1, cp=4) == net
    assert c.bandwidth("pp", tp=1, pp=8) == net and c.bandwidth("dp", tp=1, pp=8) == nvlink
    assert c.bandwidth("ep", tp=1, pp=1, ep=8, etp=1) == nvlink and c.bandwidth("ep", tp=1, pp=1, ep=16, etp=1) == net


def test_uneven_pipeline_split_is_megatrons():
    assert uneven_split(61, 16) == (3, 2)  # DeepSeek-V3's recipe
    assert uneven_split(40, 7) == (5, 5) and uneven_split(61, 32) is None and uneven_split(10, 2) is None
    words, config, base = _model(7, 4, 128, 1024, 16)
    lay = Layout(tp=1, pp=3, dp=1, first_stage_layers=2, last_stage_layers=2, micro_batch_size=1)
    cfg = plan_config(words + layout_args(lay), 3, plan_cli.build_parser())
    assert (cfg.parallel.decoder_first_pipeline_num_layers, cfg.parallel.decoder_last_pipeline_num_layers) == (2, 2)


def test_muon_and_multi_latent_attention_are_planned():
    words, config, base = _model(4, 8, 256, 1024, 16, "--multi-latent-attention", "--q-lora-rank", "64",
                                 "--kv-lora-rank", "32", "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16",
                                 "--v-head-dim", "32", "--qk-layernorm", "--position-embedding-type", "rope")
    cluster = Cluster(8, 8, device_preset("h100-80gb"))
    lay = Layout(tp=2, pp=1, dp=4, zero_stage=1, micro_batch_size=1)
    adam = evaluate(config.model, lay, cluster, base, global_batch_size=16, precision="bf16", optimizer="adamw")
    muon_base = plan_of(parse_args(words + ["--optimizer", "muon"], 1, check_files=False, planning=True))
    muon = evaluate(config.model, lay, cluster, muon_base, global_batch_size=16, precision="bf16", optimizer="muon")
    assert muon.memory.optimizer < adam.memory.optimizer  # one momentum on the matrices
    assert muon.time.terms["optimizer"] > adam.time.terms["optimizer"]  # Newton-Schulz
    assert muon.time.terms["dp"] > adam.time.terms["dp"]  # the exchange with the matrices' owners
    # half Adam's states short of room: AdamW offloads them, Muon (which refuses offload) has no plan
    fixed = Restrictions(tp=1, pp=1, cp=1, zero_stages=(1,), micro_batch_size=1, recompute=(None,))
    one = evaluate(config.model, Layout(tp=1, pp=1, dp=8, zero_stage=1, micro_batch_size=1), cluster, base,
                   global_batch_size=16, precision="bf16", optimizer="adamw").memory
    small = Cluster(8, 8, device_preset("h100-80gb", memory_gib=(one.device_total - one.optimizer / 2) / GiB),
                    reserve_gib=0.0)
    kw = dict(global_batch_size=16, precision="bf16", restrictions=fixed)
    with_adam = search(config.model, small, base, optimizer="adamw", **kw)
    with_muon = search(config.model, small, muon_base, optimizer="muon", **kw)
    assert with_adam.plans and all(p.layout.offload_optimizer for p in with_adam.plans)
    assert not with_muon.plans and not with_muon.closest.layout.offload_optimizer


def _errors(capsys) -> list[str]:
    return [line for line in capsys.readouterr().err.splitlines() if line.strip()]


@pytest.mark.parametrize("argv,rc,says", [
    (["--world-size", "8", "--gpu", "v100", "--model-preset", "gpt-13b", "--global-batch-size", "64"], 2,
     "unknown GPU 'v100': the presets are a100-80gb"),
    (["--world-size", "13", "--model-preset", "gpt-13b", "--global-batch-size", "8"], 2,
     "no layout of 13 GPUs runs this model"),
    (["--world-size", "8", "--model-preset", "gpt-13b"], 2, "give --global-batch-size"),
    (["--world-size", "8", "--model-preset", "gpt-13b", "--global-batch-size", "16", "--micro-batch-size", "3"], 2,
     "no micro-batch size 3 splits each data-parallel rank's"),
    (["--model-preset", "gpt-13b", "--global-batch-size", "8"], 2, "give --world-size"),
    (["--world-size", "8", "--model-preset", "gpt-13b", "--global-batch-size", "8", "--optimizer-cpu-offload"], 2,
     "the planner offloads where nothing fits"),
    (["--world-size", "8", "--model-preset", "gpt-13b", "--global-batch-size", "8", "--zero-stages", "1,5"], 2,
     "--zero-stages '1,5'"),
])
def test_bad_input_is_one_line(capsys, argv, rc, says):
    assert plan_cli.main(argv) == rc
    lines = _errors(capsys)
    assert len(lines) == 1 and lines[0].startswith("error:") and says in lines[0], lines


def test_a_model_that_fits_nowhere_is_told_what_would_fit(capsys):
    argv = ["--world-size", "1", "--gpu", "a100-80gb", "--model-preset", "gpt-13b", "--global-batch-size", "8",
            "--bf16", "--no-offload"]
    assert plan_cli.main(argv) == 1
    lines = _errors(capsys)
    assert len(lines) == 1 and "GiB more; a plan fits with --world-size" in lines[0], lines


def test_layout_flags_among_pretrain_flags_fix_the_choice(tmp_path, capsys):
    out = tmp_path / "p.json"
    words, _, _ = _model(4, 4, 128, 1024, 32)
    assert plan_cli.main(["--world-size", "8", "--json", str(out), *words, "--tp", "2", "--zero-stage", "3",
                          "--recompute-granularity", "full", "--vpp", "2", "--pp", "2"]) == 0
    plans = json.loads(out.read_text())["plans"]
    assert plans and all((p["tp"], p["pp"], p["vpp"], p["zero_stage"], p["recompute"]) == (2, 2, 2, 3, "full")
                         for p in plans)
