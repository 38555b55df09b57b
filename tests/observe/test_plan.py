"""The layout planner: its search against brute force, its terms, the published record, bad input."""

from __future__ import annotations

import itertools
import json
from dataclasses import replace

import pytest

from megazero.cli import plan as plan_cli
from megazero.cli.planning import plan_config
from megazero.observe.plan_devices import Cluster, device_preset
from megazero.observe.plan_record import (KORTHIKANTI_2022, NARAYANAN_2021, NARAYANAN_2021_SWEEPS,
                                          NARAYANAN_2021_TABLE2, calibrated_gemm_efficiency, constant_baseline,
                                          predicted_tflops, row_best, row_plan, row_search, sweep_result)
from megazero.observe.plan_search import MIN_CP_TOKENS, Restrictions, evaluate, layout_args, search, uneven_split
from megazero.observe.plan_time import GEMM_EFFICIENCY, TIME_TERMS, Layout
from megazero.observe.planner import GiB, plan_of
from megazero.config.arguments import parse_args
from megazero.config.train_config import ConfigError


def _model(layers: int, heads: int, hidden: int, seq: int, gbs: int, *extra: str):
    words = ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
             "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--vocab-size", "1000", "--bf16",
             "--global-batch-size", str(gbs), *extra]
    config = parse_args(words, 1, check_files=False, planning=True)
    return words, config, plan_of(config)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _launches(words: list[str], lay: Layout, world: int, parser) -> bool:
    """Whether pretrain_gpt.py's command line accepts ``lay`` at ``world`` ranks (the independent judge)."""
    try:
        plan_config(words + layout_args(lay), world, parser)
        return True
    except (ConfigError, ValueError):
        return False


def _every_plan(words, config, base, cluster, gbs) -> list:
    """Every layout of every size pretrain_gpt.py accepts, evaluated: no pruning, none of the search's rules
    on what may run; only the search's two declared priors (TP within a node, MIN_CP_TOKENS per CP rank)
    and Megatron's uneven split bound it."""
    parser, world, L, experts = plan_cli.build_parser(), cluster.world, config.num_layers, config.num_experts or 0
    plans = []
    for tp, cp, pp in itertools.product(_divisors(world), repeat=3):
        if world % (tp * cp * pp) or tp > cluster.gpus_per_node or (cp > 1 and config.seq_length // cp < MIN_CP_TOKENS):
            continue
        ends = uneven_split(L, pp) if L % pp else None
        for ep, etp in itertools.product(_divisors(experts), _divisors(world)) if experts else [(1, None)]:
            family = Layout(tp=tp, pp=pp, dp=world // (tp * cp * pp), cp=cp, ep=ep, etp=etp,
                            first_stage_layers=ends and ends[0], last_stage_layers=ends and ends[1])
            if not any(_launches(words, replace(family, sequence_parallel=sp), world, parser) for sp in (False, True)):
                continue
            for vpp, zero, sp, rc, b, offload in itertools.product(
                    _divisors(L // pp) if pp > 1 and not ends else [1], (0, 1, 2, 3), (False, True),
                    (None, "selective", "full"), _divisors(gbs // family.dp), (False, True)):
                if offload and not zero:  # nothing to offload without a ZeRO partition
                    continue
                lay = replace(family, vpp=vpp, zero_stage=zero, sequence_parallel=sp, recompute=rc,
                              micro_batch_size=b, offload_optimizer=offload)
                plans.append(evaluate(config, lay, cluster, base, global_batch_size=gbs, precision="bf16",
                                      optimizer="adamw"))
    return plans


@pytest.mark.parametrize("layers,heads,hidden,seq,experts,share,gbs", [
    (6, 16, 2048, 2048, 0, 0.3, 16),  # tp 2 ZeRO-3 SP, full recompute
    (4, 16, 4096, 4096, 0, 0.1, 8),  # tp 4 pp 2
    (7, 8, 4096, 1024, 4, 0.3, 8),  # experts: ep 4 etp 2, optimizer offload (pp 4 splits the 7 layers unevenly)
])
def test_search_picks_what_brute_force_picks(layers, heads, hidden, seq, experts, share, gbs):
    """On a device where ``share`` of all layouts fit, the search's pick is the fastest layout that fits among
    every one pretrain_gpt.py launches, and it launches."""
    moe = ["--num-experts", str(experts), "--moe-router-topk", "2"] if experts else []
    words, config, base = _model(layers, heads, hidden, seq, gbs, *moe)
    roomy = Cluster(8, 4, device_preset("h100-80gb"), reserve_gib=0.0)
    plans = _every_plan(words, config.model, base, roomy, gbs)
    memory = sorted(p.memory.device_total for p in plans)[int(share * len(plans))]
    cluster = replace(roomy, device=device_preset("h100-80gb", memory_gib=memory / GiB))
    fits = [p for p in plans if p.memory.device_total <= cluster.usable_bytes and p.memory.host_total <= p.host]
    fitting = sorted(fits, key=lambda p: p.step_time_s)
    parser = plan_cli.build_parser()
    best = next(p for p in fitting if _launches(words, p.layout, 8, parser))
    found = search(config.model, cluster, base, global_batch_size=gbs, precision="bf16")
    assert found.plans[0].step_time_s == pytest.approx(best.step_time_s, rel=1e-12), (found.plans[0].layout,
                                                                                     best.layout)
    assert _launches(words, found.plans[0].layout, 8, parser)
    assert [p.step_time_s for p in found.plans] == sorted(p.step_time_s for p in found.plans)


def test_json_plans_launch_their_layout(tmp_path, capsys):
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
    assert "chosen:" in text and "launch: torchrun" in text


def test_the_other_families_are_grouped_and_verbose_lists_each(tmp_path, capsys):
    """By default one line per reason a family lost, every family counted once; --verbose one line each."""
    out = tmp_path / "plans.json"
    words, _, _ = _model(6, 4, 128, 1024, 16)
    argv = ["--world-size", "8", "--json", str(out), *words]
    assert plan_cli.main(argv) == 0
    text = capsys.readouterr().out.splitlines()
    rejected = json.loads(out.read_text())["rejected"]
    groups = text[text.index(next(line for line in text if line.startswith("the other"))) + 1:]
    counts = [int(line.split(": ")[1].split()[0]) for line in groups]
    assert sum(counts) == len(rejected) and len(groups) < len(rejected) and len(text) <= 150
    assert len({line.split(": ")[0] for line in groups}) == len(groups)  # each reason once
    assert plan_cli.main(argv + ["--verbose"]) == 0
    text = capsys.readouterr().out.splitlines()
    listed = text[text.index("the other families (tp, cp, pp, ep):") + 1:]
    assert len(listed) == len(rejected)
    assert all(line == f"  tp {r['tp']} cp {r['cp']} pp {r['pp']}: {r['reason']}" for line, r in zip(listed, rejected))


def test_an_offloading_plan_says_its_host_memory(tmp_path, capsys):
    words, config, base = _model(4, 8, 256, 1024, 16)
    cluster = Cluster(8, 8, device_preset("h100-80gb"))
    lay = Layout(tp=1, pp=1, dp=8, zero_stage=1, micro_batch_size=1)
    one = evaluate(config.model, lay, cluster, base, global_batch_size=16, precision="bf16", optimizer="adamw")
    offloaded = evaluate(config.model, replace(lay, offload_optimizer=True), cluster, base, global_batch_size=16,
                         precision="bf16", optimizer="adamw").memory
    memory = (one.memory.device_total - one.memory.optimizer / 2) / GiB  # room only with the state offloaded
    out = tmp_path / "plans.json"
    assert plan_cli.main(["--world-size", "8", "--device-memory-gb", f"{memory:.6f}", "--memory-reserve-gb", "0",
                          "--tp", "1", "--pp", "1", "--zero-stage", "1", "--micro-batch-size", "1", "--recompute",
                          "none", "--json", str(out), *words]) == 0
    text = capsys.readouterr().out
    [plan] = json.loads(out.read_text())["plans"]
    assert plan["offload_optimizer"] and plan["host_bytes"] == offloaded.host_total > 0
    assert "host GiB" in text and f"host {offloaded.host_total / GiB:.2f} GiB per GPU" in text


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


def test_narayanan_table_1_beats_the_best_constant():
    """Table 1 without its calibration row (a validation set: the constants were chosen with it in view). A
    constant TFLOP/s, even the best one in hindsight (5.6 % mean), fails these bounds, as does the time model
    before its per-layer overhead (4.8 % mean, 10.2 % max, recalibrated); the published (tp, pp) is among the
    planner's three fastest families for at least 8 of the 10 rows."""
    rows = NARAYANAN_2021[1:]
    errors = [abs(row_plan(row).tflops_per_gpu / row.tflops - 1) for row in rows]
    constant = min(sum(abs(c / row.tflops - 1) for row in rows) / len(rows) for c in (r.tflops for r in rows))
    mean = sum(errors) / len(errors)
    assert mean < 0.045 and max(errors) < 0.10 and mean < 0.8 * constant, (mean, max(errors), constant)
    in_top3 = sum((row.tp, row.pp) in [(f.key[0], f.key[2]) for f in row_search(row).families if f.best][:3]
                  for row in NARAYANAN_2021)
    assert in_top3 >= 8


def test_korthikanti_table_5_step_times():
    """Table 5 shaped the per-layer overhead (a validation set); the form it replaced misses by 12.3 % mean,
    22.2 % max."""
    errors = []
    for row in KORTHIKANTI_2022:
        for plan, measured in ((row_plan(row), row.step_full_s),
                               (row_plan(row, recompute="selective", sequence_parallel=True), row.step_selective_s)):
            errors.append(plan.step_time_s / measured - 1)
    assert max(map(abs, errors)) < 0.10 and sum(map(abs, errors)) / len(errors) < 0.05, errors


def test_held_out_record():
    """Published measurements the model was never chosen on: Narayanan et al. 2021's Table 2 (PTD-P) is
    predicted closer than Table 1's mean utilization predicts it, with its fall in throughput as the GPUs
    double at a fixed batch; Figure 13's finding, tensor parallelism up to the node, holds at both batch
    sizes. (What does not hold is in docs/benchmarks.md.)"""
    predicted = {row: predicted_tflops(row, row_best(row)) for row in NARAYANAN_2021_TABLE2}
    ours = [abs(p / row.tflops - 1) for row, p in predicted.items()]
    constant = [abs(constant_baseline(row) / row.tflops - 1) for row in predicted]
    assert sum(ours) < sum(constant), (ours, constant)
    for name in ("174.6B", "529.6B"):
        by_gpus = [predicted[row] for row in NARAYANAN_2021_TABLE2 if row.name == name]
        assert by_gpus == sorted(by_gpus, reverse=True)
    figure_13 = sweep_result(NARAYANAN_2021_SWEEPS[0])
    assert [holds for _, _, holds in figure_13] == [True, True], figure_13


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
