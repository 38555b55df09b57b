"""tools/rehearse.py: ranks of a 16-rank launch of a 1.3B GPT rehearsed in one CPU process (meta
device, fake process groups), checked against the ZeRO formulas of megazero.observe.planner; and a
tiny rehearsed rank against the same run done for real."""

from __future__ import annotations

import dataclasses
import json
import socket
import sys
from pathlib import Path

import pytest
import torch

from megazero.observe.planner import estimate_memory_for, model_state_bytes, traffic_bytes_per_step
from megazero.observe.rehearsal import default_ranks, rehearsal_config, rehearse_rank
from tests import background

ROOT = Path(__file__).resolve().parents[2]
WORLD = 16
# A 1.3B GPT (24 layers, hidden 2048) at its real shapes: seq 2048, bf16, full recompute.
MODEL = ["--model-preset", "gpt-1.3b", "--vocab-size", "50257", "--bf16", "--lr", "1e-4",
         "--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


# The rehearsals tools/rehearse.py runs for the tests named: test -> (its flags, the tool's flags).
REHEARSALS = {
    # tp 2 x pp 2 x dp 4, two micro-batches per iteration; rank 0 (first stage) and 15 (last stage, tp 1, dp 3).
    "test_zero1_pipeline_two_ranks_against_the_formulas_and_a_device_limit": (
        ["--tp", "2", "--pp", "2", "--zero-stage", "1", "--micro-batch-size", "1", "--global-batch-size", "8"],
        ["--ranks", "0,15", "--device-memory-gb", "1"]),
    # tp 2 x dp 8, ZeRO-3, one micro-batch; default ranks: dp 0 and dp 7 at tp 0.
    "test_zero3_two_ranks_against_the_formulas": (
        ["--tp", "2", "--zero-stage", "3", "--micro-batch-size", "1", "--global-batch-size", "8"], []),
}


def _start(out: Path, flags: list[str], tool_flags: list[str]):
    """tools/rehearse.py writing ``out``, in the background (tests/background.py): the future of its process."""
    return background.run([sys.executable, str(ROOT / "tools" / "rehearse.py"), "--world-size", str(WORLD),
                           "--json", str(out), *tool_flags, "--", *MODEL, *flags],
                          {"PYTHONPATH": str(ROOT)}, timeout=300, cwd=str(ROOT))


def _finished(future, out: Path) -> tuple[int, dict, str]:
    proc = future.result()
    assert out.exists(), proc.stdout + proc.stderr
    return proc.returncode, json.loads(out.read_text()), proc.stdout + proc.stderr


def _rehearse(tmp_path, name: str, flags: list[str], *tool_flags: str) -> tuple[int, dict, str]:
    out = tmp_path / f"{name}.json"
    return _finished(_start(out, flags, list(tool_flags)), out)


@pytest.fixture(scope="module")
def rehearsals(request, tmp_path_factory):
    """The rehearsals of this session's tests of this module, started together (each is one single-threaded
    process): test -> (future of the process, its JSON file)."""
    tmp = tmp_path_factory.mktemp("rehearsals")
    tests = {getattr(item, "originalname", "") for item in request.session.items
             if getattr(item, "module", None) is request.module}
    started = {}
    for name in sorted(tests & REHEARSALS.keys()):
        flags, tool_flags = REHEARSALS[name]
        started[name] = (_start(tmp / f"{name}.json", flags, tool_flags), tmp / f"{name}.json")
    return started


def _rehearsed(rehearsals, name: str) -> tuple[int, dict, str]:
    return _finished(*rehearsals[name])


def _formula_state(config, pp_rank: int) -> float:
    """The ZeRO paper's per-rank model state (megazero.observe.planner) for this rank's stage."""
    est = estimate_memory_for(config)
    p = config.parallel
    psi = est.pipeline["stages"][pp_rank]["params"] if p.pp > 1 else est.params_per_rank
    return sum(model_state_bytes(psi, dp=p.dp, zero_stage=p.zero_stage, precision=config.precision.dtype)), psi


def _check_rank(r: dict, config) -> float:
    assert set(r) >= {"rank", "tp_rank", "pp_rank", "dp_rank", "state_bytes", "peak_bytes", "peak_by_kind",
                      "sent_bytes"}
    assert set(r["sent_bytes"]) >= {"tp", "pp", "dp", "embedding"}
    formula, psi = _formula_state(config, r["pp_rank"])
    assert 0.95 * formula <= r["state_bytes"] <= 1.05 * formula, (r["state_bytes"], formula)
    assert r["peak_bytes"] >= r["state_bytes"]
    assert sum(r["peak_by_kind"].values()) == r["peak_bytes"]
    assert r["peak_by_kind"]["state"] == r["state_bytes"]  # nothing of the state is freed in iteration 2
    return psi


def test_zero1_pipeline_two_ranks_against_the_formulas_and_a_device_limit(rehearsals):
    flags, _ = REHEARSALS["test_zero1_pipeline_two_ranks_against_the_formulas_and_a_device_limit"]
    code, doc, out = _rehearsed(rehearsals, "test_zero1_pipeline_two_ranks_against_the_formulas_and_a_device_limit")
    assert code == 1 and "exceeds --device-memory-gb 1" in out, out  # every rank holds ~3 GiB
    config, _ = rehearsal_config(MODEL + flags, WORLD)
    assert [r["rank"] for r in doc["ranks"]] == [0, 15]
    assert [(r["tp_rank"], r["pp_rank"], r["dp_rank"]) for r in doc["ranks"]] == [(0, 0, 0), (1, 1, 3)]
    for r in doc["ranks"]:
        psi = _check_rank(r, config)
        traffic = traffic_bytes_per_step(config.model, psi=psi, tp=2, dp=4, zero_stage=1, microbatches=2,
                                         micro_batch_size=1, seq_length=2048, precision="bf16", layers=12,
                                         recompute=config.model.recompute_granularity)
        # ZeRO-1: the bf16 weights are all-gathered after the step, the gradients reduce-scattered in fp32.
        assert r["sent_by_op"]["dp/allgather_base"] == pytest.approx(traffic["dp_all_gather"], rel=0.03)
        assert r["sent_by_op"]["dp/reduce_scatter_base"] == pytest.approx(traffic["dp_reduce"], rel=0.03)
        # Two micro-batches of [2048, 1, 2048] bf16 activations (8 MiB) to the next stage or back.
        assert r["sent_bytes"]["pp"] == 2 * 2048 * 2048 * 2
        assert r["sent_bytes"]["embedding"] > 0  # the tied word embedding's gradient, first <-> last stage
        assert r["sent_bytes"]["tp"] == pytest.approx(traffic["tp"], rel=0.05)  # + the embedding's and the loss's
        assert sum(r["host_reads"].values()) == 1, r["host_reads"]  # the gradient norm


def test_zero3_two_ranks_against_the_formulas(rehearsals):
    flags, _ = REHEARSALS["test_zero3_two_ranks_against_the_formulas"]
    code, doc, out = _rehearsed(rehearsals, "test_zero3_two_ranks_against_the_formulas")
    assert code == 0, out
    config, _ = rehearsal_config(MODEL + flags, WORLD)
    assert [r["rank"] for r in doc["ranks"]] == default_ranks(config) == [0, 14]
    for r in doc["ranks"]:
        psi = _check_rank(r, config)
        traffic = traffic_bytes_per_step(config.model, psi=psi, tp=2, dp=8, zero_stage=3, microbatches=1,
                                         micro_batch_size=1, seq_length=2048, precision="bf16", layers=24,
                                         recompute=config.model.recompute_granularity)
        # Gathered in forward and again in backward (bf16), gradients reduce-scattered in fp32
        # (persistent small parameters are never gathered: a little less).
        dp = r["sent_by_op"]
        assert dp["dp/allgather_base"] == pytest.approx(traffic["dp_all_gather"], rel=0.05)
        assert dp["dp/reduce_scatter_base"] == pytest.approx(traffic["dp_reduce"], rel=0.05)
        assert r["peak_by_kind"].get("gathered", 0) > 0  # units regrown in place
        # After the first step the forward agreement is kept: the step's norm is the one read left.
        assert sum(r["host_reads"].values()) == 1, r["host_reads"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tiny_rank_rehearsed_equals_the_real_run(monkeypatch):
    """One process, gpt-tiny, ZeRO-1: the state after iteration 1 and the peak of iteration 2 of the
    rehearsal (meta) equal those of the same run on the CPU measured by LiveMemoryTracker, up to the
    loader's host batches (the real run's device is the host). The math attention backend on both:
    the rehearsal's meta device otherwise picks flash attention, as CUDA would, and the CPU does not."""
    import torch.distributed as dist

    from megazero import mpu
    from megazero.training.loop import Callback
    from megazero.training.trainer import pretrain
    from megazero.utils import LiveMemoryTracker

    argv = ["--model-preset", "gpt-tiny", "--zero-stage", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "1000", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--bf16",
            "--attention-backend", "unfused",
            # CPU's dropout keeps a mask of the input's dtype, CUDA's (and so the rehearsal's) a bool one
            "--hidden-dropout", "0", "--attention-dropout", "0"]
    config, _ = rehearsal_config(argv, 1)
    rehearsed = rehearse_rank(config, 0)

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    real: dict = {}
    tracker = LiveMemoryTracker("cpu", scan_existing=False)

    class Measure(Callback):
        def on_train_start(self, state, run):
            self.run = run

        def on_step_end(self, state, result):
            if state.iteration == 1:
                real["state"] = tracker.absolute_current_bytes
                real["engine"] = self.run.engine.model_state_bytes()["total"]
                tracker.reset_peak()
            else:
                real["peak"] = tracker.absolute_peak_bytes

    rng = torch.get_rng_state()
    try:
        with tracker:
            pretrain(config, callbacks=[Measure()])
    finally:
        mpu.destroy_model_parallel()
        dist.destroy_process_group()
        torch.set_rng_state(rng)
    assert rehearsed.engine_state_bytes == real["engine"]
    loader_batches = 2 * 2 * 65 * 8  # two micro-batches of [2, seq + 1] int64 tokens, held by the loop on the host
    assert 0 <= real["state"] - rehearsed.state_bytes <= loader_batches + 64, (real, rehearsed.state_bytes)
    assert rehearsed.peak_bytes == pytest.approx(real["peak"], rel=0.01)


def test_rehearsal_reports_the_nccl_communicators_and_counts_them_against_the_device(capsys):
    """tp 2 x dp 2, ZeRO-3: rank 0 joins the default group, tp, dp and model-parallel on a GPU (the
    gradient reduce-scatters share the DP communicator): 4 x the per-communicator estimate, printed
    beside the rehearsed peak and counted against --device-memory-gb."""
    from megazero.cli.rehearse import main
    from megazero.observe.gpu_overheads import NCCL_COMMUNICATOR_BYTES
    from megazero.observe.rehearsal import format_report

    argv = ["--model-preset", "gpt-tiny", "--tp", "2", "--zero-stage", "3", "--mock-data", "--tokenizer-type",
            "NullTokenizer", "--vocab-size", "1000", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--lr", "1e-3", "--bf16"]
    config, _ = rehearsal_config(argv, 4)
    r = rehearse_rank(config, 0)
    assert r.nccl_communicators == {"world": 1, "tp": 1, "dp": 1, "mp": 1}
    assert r.nccl_bytes == 4 * NCCL_COMMUNICATOR_BYTES == 1_233_125_376
    text = format_report(r)
    assert "on a GPU, NCCL communicators: 4 x ~294 MiB (estimate) = 1176 MiB per GPU (world, tp, dp, mp;" in text
    assert "share the DP communicator on NCCL: 0 more" in text
    offloaded = format_report(dataclasses.replace(r, host_bytes=1 << 20))
    assert "host memory of the offloads is exact: one exact-size allocation per offload object" in offloaded
    # A 2 MiB peak fits 1 GiB; with the communicators' 1.15 GiB it does not.
    assert r.peak_bytes < 2 ** 21
    assert main(["--world-size", "4", "--ranks", "0", "--device-memory-gb", "1", "--"] + argv) == 1
    assert "GiB (estimate) exceeds --device-memory-gb 1" in capsys.readouterr().err


@pytest.mark.parametrize("seq,cp,exchange", [(32768, 1, "p2p"), (131072, 1, "p2p"), (32768, 8, "p2p"),
                                              (131072, 8, "p2p"), (131072, 8, "a2a"), (131072, 8, "allgather"),
                                              (131072, 8, "a2a+p2p")])
def test_the_plan_is_within_ten_percent_of_the_rehearsal_for_long_sequences(seq, cp, exchange):
    # Rank 0 of cp ranks, 4 layers of hidden 2048, bf16, ZeRO-1 (over the cp ranks), a score-free
    # attention kernel (flash on a GPU; the rehearsal runs the CUDA ops' meta memory): the peak is the
    # loss's logits beside every layer's activations for seq / cp tokens, and the all-gather
    # exchange's K/V of the whole sequence.
    flags = ["--num-layers", "4", "--hidden-size", "2048", "--num-attention-heads", "16", "--seq-length", str(seq),
             "--max-position-embeddings", str(seq), "--micro-batch-size", "1", "--global-batch-size", "1",
             "--bf16", "--zero-stage", "1", "--vocab-size", "32000", "--tokenizer-type", "NullTokenizer",
             "--mock-data", "--train-iters", "1", "--lr", "1e-4", "--attention-backend", "flash",
             "--context-parallel-size", str(cp), "--cp-comm-type", exchange, "--attention-dropout", "0"]
    if exchange == "a2a+p2p":
        flags += ["--hierarchical-context-parallel-sizes", "2", "4"]
    config, _ = rehearsal_config(flags, cp)
    report = rehearse_rank(config, 0)
    if cp > 1:  # the groups a rank of the launch joins, hierarchical ones included
        assert {"cp", "dp_cp"} <= set(report.nccl_communicators), report.nccl_communicators
        assert ("hcp_a2a" in report.nccl_communicators) == (exchange == "a2a+p2p")
    assert report.plan["state_bytes"] == pytest.approx(report.state_bytes, rel=0.01)
    assert report.plan["peak_bytes"] == pytest.approx(report.peak_bytes, rel=0.10), (report.plan, report.peak_bytes)


MIXTRAL = ["--num-layers", "32", "--hidden-size", "4096", "--num-attention-heads", "32", "--num-query-groups", "8",
           "--ffn-hidden-size", "14336", "--seq-length", "4096", "--max-position-embeddings", "32768",
           "--micro-batch-size", "1", "--global-batch-size", "64", "--bf16", "--vocab-size", "32000",
           "--make-vocab-size-divisible-by", "128", "--tokenizer-type", "NullTokenizer", "--mock-data",
           "--train-iters", "1", "--lr", "1e-4", "--num-experts", "8", "--moe-router-topk", "2",
           "--disable-bias-linear", "--swiglu", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
           "--untie-embeddings-and-output-weights", "--attention-backend", "flash", "--hidden-dropout", "0",
           "--attention-dropout", "0"]


def test_a_mixtral_8x7b_launch_on_64_ranks_is_rehearsed_against_the_formula():
    """tp 1, pp 4, ep 8 (expert data parallel 2), bf16, the distributed optimizer: each rank holds a
    quarter of the layers and one expert of each; its state is the planner's and the formula's, and
    what it sends per group (the experts' all-to-all, expert data parallel, data parallel, pipeline)
    is what the plan says."""
    from megazero.model.flops import active_parameters, expert_parameters, num_parameters
    from megazero.observe.rehearsal import sent_by_plan_group

    config, _ = rehearsal_config(MIXTRAL + ["--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8",
                                            "--use-distributed-optimizer"], 64)
    hf_shape = config.model.replace(vocab_size=32000)  # the Hub's count: the unpadded vocabulary
    assert (num_parameters(hf_shape), active_parameters(hf_shape)) == (46_702_792_704, 12_879_925_248)
    experts = expert_parameters(config.model)
    assert experts == 45_097_156_608
    for rank in (0, 63):  # first and last stage
        r = rehearse_rank(config, rank)
        assert r.plan["state_bytes"] == pytest.approx(r.state_bytes, rel=0.01), (rank, r.plan, r.state_bytes)
        assert r.plan["peak_bytes"] == pytest.approx(r.peak_bytes, rel=0.10), (rank, r.plan, r.peak_bytes)
        assert {"ep", "edp"} <= set(r.nccl_communicators)
        sent = sent_by_plan_group(r)
        for key in ("ep", "edp", "dp", "pp"):
            assert sent[key] == pytest.approx(r.plan[f"sent_{key}"], rel=0.02), (rank, key, sent, r.plan)
        # 4 all-to-alls of 4096 tokens x 2 copies x h bf16 (7/8 leave) x 8 layers x 4 micro-batches: 7 GiB
        assert sent["ep"] == pytest.approx(4 * 8 * 4 * (4096 * 2 * 4096 * 2) * 7 / 8, rel=1e-6)
        # ZeRO-1 over expert data parallel 2: bf16 weights and gradients (2 + 2 bytes) of the rank's
        # experts, and their fp32 master and Adam moments (12 bytes) halved.
        x = experts / (8 * 4)
        assert r.engine_state_bytes >= 4 * x + 12 * x / 2


def test_grouped_expert_matmuls_add_nothing_to_the_peak_of_a_mixtral_launch():
    """--moe-grouped-gemm (Megatron-LM's Mixtral script passes it) on the rehearsal's meta device: the
    grouped matmuls keep no stacked copy of the experts for backward, so rank 0 (four micro-batches in
    flight over 8 layers) peaks where the per-expert loop does."""
    flags = MIXTRAL + ["--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8",
                       "--use-distributed-optimizer"]
    peaks = [rehearse_rank(rehearsal_config(flags + extra, 64)[0], 0).peak_bytes
             for extra in ([], ["--moe-grouped-gemm"])]
    assert peaks[1] == pytest.approx(peaks[0], rel=1e-3), peaks


def test_whole_experts_under_tensor_parallelism_are_rehearsed_against_the_formula():
    """Mixtral-8x7B on 64 ranks at tp 2 with sequence parallelism, expert tensor parallelism 1, pp 4 and
    ep 8: the 16 ranks of a stage are 8 expert-parallel x 2 expert-data-parallel, each rank holding one
    whole expert per layer and routing its own tokens (the load-balancing and z losses on); the state is
    the planner's and the formula's."""
    from megazero.model.flops import expert_parameters

    config, _ = rehearsal_config(MIXTRAL + ["--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8",
                                            "--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                                            "--use-distributed-optimizer", "--moe-aux-loss-coeff", "0.01",
                                            "--moe-z-loss-coeff", "0.001"], 64)
    r = rehearse_rank(config, 0)
    assert r.plan["state_bytes"] == pytest.approx(r.state_bytes, rel=0.01), (r.plan, r.state_bytes)
    assert r.plan["peak_bytes"] == pytest.approx(r.peak_bytes, rel=0.10), (r.plan, r.peak_bytes)
    assert {"ep", "edp"} <= set(r.nccl_communicators) and "etp" not in r.nccl_communicators
    x = expert_parameters(config.model) / (8 * 4)  # one whole expert of each of the stage's 8 layers
    assert r.engine_state_bytes >= 4 * x + 12 * x / 2


def test_a_layer_pattern_with_dense_layers_first_is_planned_per_stage():
    """DeepSeek-V3's layout on Mixtral's shape: the first 8 layers dense (--moe-layer-freq ([0]*8+[1]*24)),
    pp 4: the first stage holds no experts and four dense MLPs' worth more than a mixture stage; the
    plan follows each stage's own layers."""
    config, _ = rehearsal_config(MIXTRAL + ["--pipeline-model-parallel-size", "4", "--expert-model-parallel-size", "8",
                                            "--use-distributed-optimizer", "--moe-layer-freq", "([0]*8+[1]*24)"], 64)
    first, last = rehearse_rank(config, 0), rehearse_rank(config, 63)
    for r in (first, last):
        assert r.plan["state_bytes"] == pytest.approx(r.state_bytes, rel=0.01), (r.rank, r.plan, r.state_bytes)
        # the rehearsal's unfused RMSNorm keeps an fp32 copy of its input (apex's fused one on a GPU does not)
        assert r.plan["peak_bytes"] == pytest.approx(r.peak_bytes, rel=0.20), (r.rank, r.plan, r.peak_bytes)
    assert "ep" in last.nccl_communicators and first.state_bytes < last.state_bytes


# A small GPT (4 layers, hidden 512, 8 heads in 4 KV groups, seq 512, bf16; each matrix above ZeRO-3's persistence
# threshold) at the layouts below: what rank 0 and
# the last rank send per group is what the plan says (tools/estimate_memory.py's "sent per GPU per step").
SMALL = ["--num-layers", "4", "--hidden-size", "512", "--num-attention-heads", "8", "--num-query-groups", "4",
         "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "1", "--bf16",
         "--vocab-size", "1024", "--tokenizer-type", "NullTokenizer", "--attention-backend", "flash",
         "--attention-dropout", "0", "--hidden-dropout", "0", "--swiglu", "--disable-bias-linear"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2"]
TRAFFIC_LAYOUTS = {
    "ep2 pp2 edp2": (8, MOE + ["--ep", "2", "--pp", "2", "--use-distributed-optimizer", "--global-batch-size", "4"]),
    "tp2 sp etp1 ep2 zero2": (8, MOE + ["--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
                                        "--ep", "2", "--zero-stage", "2", "--global-batch-size", "8"]),
    "ep4 capacity padded": (4, MOE + ["--ep", "4", "--moe-expert-capacity-factor", "1.0",
                                      "--moe-pad-expert-input-to-capacity", "--global-batch-size", "4"]),
    "cp2 p2p tp2 zero3 full": (4, ["--cp", "2", "--tp", "2", "--zero-stage", "3", "--recompute-granularity", "full",
                                   "--global-batch-size", "2"]),
    "cp2 a2a selective": (2, ["--cp", "2", "--cp-comm-type", "a2a", "--recompute-granularity", "selective",
                              "--global-batch-size", "2"]),
    "cp4 allgather": (4, ["--cp", "4", "--cp-comm-type", "allgather", "--global-batch-size", "1"]),
    "cp4 a2a+p2p ep2": (4, MOE + ["--cp", "4", "--cp-comm-type", "a2a+p2p", "--hierarchical-context-parallel-sizes",
                                  "2", "2", "--ep", "2", "--global-batch-size", "1"]),
}


@pytest.mark.parametrize("layout", TRAFFIC_LAYOUTS)
def test_the_plan_sends_what_the_rehearsal_sends_per_group(layout):
    """Per planned group (data, expert data, context parallel, the experts' all-to-all, pipeline; tensor
    parallel within 10 %: the embedding's and the loss's exchanges are not planned), the bytes the
    rehearsed ranks send in iteration 2 against the plan of their stage, as tools/rehearse.py prints them."""
    from megazero.observe.rehearsal import PLAN_GROUPS, sent_by_plan_group

    world, flags = TRAFFIC_LAYOUTS[layout]
    config, _ = rehearsal_config(SMALL + flags, world)
    for rank in (0, world - 1):
        r = rehearse_rank(config, rank)
        sent = sent_by_plan_group(r)
        for key in PLAN_GROUPS:
            planned = r.plan[f"sent_{key}"]
            assert sent[key] == pytest.approx(planned, rel=0.10 if key == "tp" else 0.02), (rank, key, sent, r.plan)
    p = config.parallel
    used = {"ep": p.ep > 1, "edp": p.ep > 1 and p.dp * p.cp * p.tp > p.ep * p.etp, "cp": p.cp > 1}
    assert {key for key, on in used.items() if on} == {key for key in used if sent[key] > 0}, sent


# 7 layers split unevenly as Megatron's --decoder-first/last-pipeline-num-layers give them (training's split,
# megazero.model.pipeline_split): dense at pp 2 (3 + 4 layers) on 4 ranks, and DeepSeek-V3's pattern (the first
# layer dense, the rest mixtures) at pp 3 (1 + 4 + 2 layers) with ep 2 on 6 ranks, and so with the recipe's tp 2,
# sequence parallelism, whole experts (etp 1) and a shared expert on 12 ranks.
UNEVEN_LAYOUTS = {
    "dense pp2 first 3": (4, ["--pp", "2", "--decoder-first-pipeline-num-layers", "3", "--global-batch-size", "4"],
                          [3, 4]),
    "moe pp3 first 1 last 2": (6, MOE + ["--moe-layer-freq", "([0]*1+[1]*6)", "--ep", "2", "--pp", "3",
                                         "--decoder-first-pipeline-num-layers", "1",
                                         "--decoder-last-pipeline-num-layers", "2", "--use-distributed-optimizer",
                                         "--global-batch-size", "4"], [1, 4, 2]),
    "moe tp2 sp etp1 pp3 first 1 last 2": (
        12, MOE + ["--moe-layer-freq", "([0]*1+[1]*6)", "--moe-shared-expert-intermediate-size", "256", "--ep", "2",
                   "--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--pp", "3",
                   "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "2",
                   "--use-distributed-optimizer", "--global-batch-size", "4"], [1, 4, 2]),
}


# Multi-latent attention (a query latent, values narrower than queries and keys) with RoPE, and one multi-token
# prediction depth on the last stage, beside its copy of the (untied) embedding.
MLA = ["--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "96", "--kv-lora-rank", "64", "--qk-head-dim",
       "64", "--qk-pos-emb-head-dim", "32", "--v-head-dim", "48", "--position-embedding-type", "rope",
       "--untie-embeddings-and-output-weights", "--mtp-num-layers", "1", "--num-query-groups", "8"]
UNEVEN_LAYOUTS.update({
    "mla mtp pp2 first 3": (4, MLA + ["--pp", "2", "--decoder-first-pipeline-num-layers", "3",
                                      "--global-batch-size", "4"], [3, 4]),
    "mla mtp moe tp2 sp etp1 pp3 first 1 last 2": (
        12, MLA + MOE + ["--moe-layer-freq", "([0]*1+[1]*6)", "--moe-shared-expert-intermediate-size", "256", "--ep",
                         "2", "--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--pp", "3",
                         "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "2",
                         "--use-distributed-optimizer", "--global-batch-size", "4"], [1, 4, 2]),
})


@pytest.mark.parametrize("layout", UNEVEN_LAYOUTS)
def test_an_uneven_pipeline_split_is_planned_per_stage_as_rehearsed(layout):
    """Each stage's rank 0 rehearsed (tools/rehearse.py's ranks) against the plan of its own stage: the
    model state to the byte (the ZeRO engine's count; the rank's memory a few scalars more), the bytes
    sent per planned group within 2 % (tensor parallel within 10 %: the embedding's and the loss's
    exchanges are not planned), the peak within 10 % (as at even splits: a one-layer stage shows most
    what the plan leaves out of a layer, a few per cent)."""
    from megazero.observe.planner import estimate_memory_for
    from megazero.observe.rehearsal import PLAN_GROUPS, sent_by_plan_group

    world, flags, layers = UNEVEN_LAYOUTS[layout]
    small = SMALL[:1] + ["7"] + SMALL[2:]
    config, _ = rehearsal_config(small + flags, world)
    est = estimate_memory_for(config)
    assert [st["layers"] for st in est.pipeline["stages"]] == layers
    per_stage = world // len(layers)  # the ranks of a stage: tp x dp
    for stage in range(len(layers)):
        r = rehearse_rank(config, stage * per_stage)
        assert r.pp_rank == stage
        assert r.engine_state_bytes == r.plan["state_bytes"], (stage, r.engine_state_bytes, r.plan)
        assert 0 <= r.state_bytes - r.engine_state_bytes <= 64  # a few scalars outside the ZeRO engine
        assert r.plan["peak_bytes"] == pytest.approx(r.peak_bytes, rel=0.10), (stage, r.plan, r.peak_bytes)
        sent = sent_by_plan_group(r)
        for key in PLAN_GROUPS:
            rel = 0.10 if key == "tp" else 0.02
            assert sent[key] == pytest.approx(r.plan[f"sent_{key}"], rel=rel), (stage, key, sent, r.plan)
        moe = sum(config.model.is_moe_layer(i) for i in range(sum(layers[:stage]), sum(layers[:stage + 1])))
        assert (sent["ep"] > 0) == (moe > 0)  # the dense first stage of the pattern sends no all-to-all
    assert est.pipeline["worst_stage"] == max(est.pipeline["stages"], key=lambda st: st["total"])["stage"]


def test_a_deepseek_v3_launch_on_1024_ranks_is_rehearsed_against_the_count_of_what_each_stage_holds(tmp_path):
    """examples/recipes/deepseek_v3_moe.sh (DeepSeek-V3-671B: multi-latent attention, 256 experts, one MTP
    depth) on 1024 ranks: tp 2 with SP x pp 16 (3 dense layers first, 2 last) x dp 32, ep 64 with whole
    experts (etp 1, expert data parallel 1), the distributed optimizer, 16 of the batch's micro-batches
    (the first stage's in flight). The first stage holds the embedding and 3 dense layers; the last 2
    mixture layers, the MTP depth (a mixture layer of its own), the head and a copy of the embedding.
    Each one's model state is the count of those parameters (bf16 weights and fp32 gradients, 2 + 4
    bytes, the fp32 master and Adam moments, 12, over dp 32; the routed experts' 18 whole), to the byte
    in the ZeRO engine and in the plan; the peak (the shared embedding's gradient exchange) and the
    bytes sent per group are the plan's."""
    from megazero.model.flops import attention_parameters, mlp_parameters
    from megazero.observe.rehearsal import PLAN_GROUPS, sent_by_plan_group
    from tests.training.test_recipes import recipe_command

    _, argv = recipe_command("deepseek_v3_moe", tmp_path)
    config, _ = rehearsal_config(argv, 1024, micro_batches=16)
    c, p = config.model, config.parallel
    assert (p.tp, p.pp, p.dp, p.ep, p.etp, c.mtp_num_layers) == (2, 16, 32, 64, 1, 1)
    h, word = c.hidden_size, c.padded_vocab_size * c.hidden_size // 2
    attention, replicated = attention_parameters(c)
    dense_mlp, shared_and_router = mlp_parameters(c)
    router = c.num_experts * h
    attention = (attention - replicated) // 2 + replicated + 2 * h  # TP-local, with the layer's two norms
    dense, mixture = attention + dense_mlp // 2, attention + (shared_and_router - router) // 2 + router
    experts = 3 * (c.num_experts // 64) * 3 * h * c.moe_ffn_size  # 4 whole SwiGLU experts of 3 mixture layers
    first = word + 3 * dense
    mtp = 3 * h + 2 * h * h // 2 + mixture  # its norms, eh_proj [h, 2h] and its layer
    last = 2 * mixture + mtp + h + word + word  # the final norm, the head and the embedding's copy
    for rank, stage, dense_params, expert_params in ((0, 0, first, 0), (960, 15, last, experts)):
        r = rehearse_rank(config, rank)
        assert (r.pp_rank, r.tp_rank, r.dp_rank) == (stage, 0, 0)
        count = dense_params * (2 + 4) + dense_params * 12 // 32 + expert_params * (2 + 4 + 12)
        assert r.engine_state_bytes == r.plan["state_bytes"] == count, (stage, r.engine_state_bytes, r.plan, count)
        # beyond the engine's parameters: the routers' expert biases and token counts (fp32) and a few scalars
        assert 0 <= r.state_bytes - r.engine_state_bytes <= (2 * 4 * 256 * 3 if stage else 0) + 64
        assert r.plan["peak_bytes"] == pytest.approx(r.peak_bytes, rel=0.10), (stage, r.plan, r.peak_bytes)
        sent = sent_by_plan_group(r)
        for key in PLAN_GROUPS:
            assert sent[key] == pytest.approx(r.plan[f"sent_{key}"], rel=0.10 if key == "tp" else 0.02), (stage, key)
        assert (sent["ep"] > 0) == (stage == 15)
        assert r.sent_bytes["embedding"] == 4 * word  # the fp32 gradient of the embedding, to the other stage
