"""Memory planner: ZeRO-paper and Korthikanti formulas on hand-worked cases, the CLI, and
the 13B launch script's dry run."""

import importlib.util
import re
from pathlib import Path

import pytest

from megazero.model.config import GPTConfig, gpt_preset
from megazero.model.flops import flops_per_iteration, num_parameters
from megazero.observe.planner import (activation_bytes_per_layer, estimate_memory, model_state_bytes,
                                      replicated_parameters)
from tests import background

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "azure" / "run_gpt_13b.sh"


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- model states (ZeRO paper, Fig. 1 / Sec. 5: Psi = 7.5B, N_d = 64, K = 12) -------------------

@pytest.mark.parametrize("stage, gb", [(0, 120.0), (1, 31.40625), (2, 16.640625), (3, 1.875)])
def test_zero_paper_example(stage, gb):
    # The paper's 2 + 2 + K: bf16 gradients (megazero's default accumulates them in fp32).
    assert sum(model_state_bytes(7.5e9, dp=64, zero_stage=stage, precision="bf16", grad_accum_dtype="bf16")) == gb * 1e9


def test_bf16_gradients_default_to_fp32():
    # Megatron's distributed-optimizer figure: 18 bytes per parameter without partitioning.
    assert sum(model_state_bytes(100, dp=1, zero_stage=0, precision="bf16")) == 1800


def test_state_split_fp32_and_fp32_grads():
    assert model_state_bytes(100, dp=4, zero_stage=0, precision="fp32") == (400, 400, 800)
    assert model_state_bytes(100, dp=4, zero_stage=3, precision="fp32") == (100, 100, 200)
    assert model_state_bytes(100, dp=4, zero_stage=1, precision="bf16", grad_accum_dtype="fp32") == (200, 400, 300)


def test_monotonic_in_dp_and_stage():
    c = gpt_preset("1.3b")
    totals = [[estimate_memory(c, tp=1, dp=dp, zero_stage=z, micro_batch_size=1).model_states for z in range(4)]
              for dp in (1, 2, 8, 64)]
    assert len(set(totals[0])) == 1  # dp = 1: nothing to partition over
    for row in totals[1:]:
        assert row == sorted(row, reverse=True) and len(set(row)) == 4
    for z in range(1, 4):
        column = [row[z] for row in totals]
        assert column == sorted(column, reverse=True) and len(set(column)) == 4
    assert totals[0][3] / totals[3][3] == 64
    assert len({row[0] for row in totals}) == 1  # stage 0 does not partition


def test_tp_local_params_count_replicated_weights_once():
    c = gpt_preset("gpt-tiny")  # l=2, h=64, V=512, positions 64
    assert num_parameters(c) == 12 * 2 * 64 ** 2 + 13 * 2 * 64 + (512 + 64) * 64 + 2 * 64 == 136960
    # norms 2 x 2h + row-parallel biases 2h per layer, final norm 2h, position table 64h
    assert replicated_parameters(c) == 2 * 6 * 64 + 2 * 64 + 64 * 64 == 4992
    est = estimate_memory(c, tp=2, dp=1, zero_stage=0, micro_batch_size=1)
    assert est.params_per_rank == (136960 - 4992) / 2 + 4992 == 70976
    assert est.params == 2 * 70976 and est.optimizer == 12 * 70976


# --- activations (Korthikanti et al. 2022, Sec. 4) ------------------------------------------------
# s=32, b=2, h=64, a=4: sbh = 4096, 5as/h = 10

SMALL = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32,
                  max_position_embeddings=32)


@pytest.mark.parametrize("tp, sp, scores, per_layer", [
    (1, False, True, 4096 * (34 + 10)),  # sbh(34 + 5as/h)
    (2, False, True, 4096 * (10 + 24 / 2 + 10 / 2)),  # sbh(10 + 24/t + 5as/(ht))
    (2, True, True, 4096 * (34 / 2 + 10 / 2)),  # sbh(34/t + 5as/(ht))
    (1, False, False, 4096 * 34),  # selective recompute / flash attention
    (2, True, False, 4096 * 34 / 2),
])
def test_korthikanti_per_layer(tp, sp, scores, per_layer):
    got = activation_bytes_per_layer(SMALL, micro_batch_size=2, seq_length=32, tp=tp, sequence_parallel=sp,
                                     keep_attention_scores=scores)
    assert got == per_layer


def test_activation_totals_by_recompute_mode():
    # dropout mask, norm + logit-layer inputs, the logits (bf16) beside the loss's fp32 copy
    outside = 4096 * (1 + 2 * 2) + (4 + 2) * 32 * 2 * 128
    kw = dict(tp=1, dp=1, zero_stage=0, micro_batch_size=2)
    assert estimate_memory(SMALL, **kw).activations == 2 * 4096 * 44 + outside
    assert estimate_memory(SMALL, recompute="selective", **kw).activations == 2 * 4096 * 34 + outside
    assert estimate_memory(SMALL, flash_attn=True, **kw).activations == 2 * 4096 * 34 + outside
    # full: each layer keeps its 2sbh input, plus one layer's activations while it is recomputed
    assert estimate_memory(SMALL, recompute="full", **kw).activations == 2 * 2 * 4096 + 4096 * 44 + outside
    fp32 = estimate_memory(SMALL, precision="fp32", **kw).activations
    assert fp32 == 2 * 4096 * (4 * 4 + 2 + 4 * 12 + 10 * 9 / 5) + 4096 * (1 + 2 * 4) + (4 + 4) * 32 * 2 * 128


def test_13b_plan_and_flops():
    c = gpt_preset("13b")
    est = estimate_memory(c, tp=4, dp=16, zero_stage=3, micro_batch_size=2, precision="bf16", recompute="full",
                          global_batch_size=1024)
    assert est.flops_per_iteration == flops_per_iteration(c, 1024, 2048, recompute_full=True)
    assert est.total < 8 * 2 ** 30 and "total" in est.to_text(80) and "fits" in est.to_text(80)


# --- CLI and launch script ---------------------------------------------------------------------

def test_cli_exit_codes(capsys):
    tool = load_tool("estimate_memory")
    base = "--model-preset 13b --tp 4 --dp 16 --zero-stage 3 --micro-batch-size 2 --bf16 --recompute full".split()
    assert tool.main(base + ["--gpu-memory-gb", "80", "--global-batch-size", "1024"]) == 0
    out = capsys.readouterr().out
    assert "parameters: 12,855,592,960" in out  # vocabulary padded to 50,688 at tp 4, as training pads and "FLOPs per iteration (global batch 1024)" in out
    assert tool.main(base + ["--gpu-memory-gb", "2"]) == 1
    err = capsys.readouterr().err
    assert re.search(r"needs [\d.]+ GiB per GPU, [\d.]+ GiB more than the 2 GiB available", err)
    assert tool.main("--model-preset 13b --tp 1 --dp 8 --zero-stage 1 --micro-batch-size 1 --bf16 "
                     "--gpu-memory-gb 80".split()) == 1
    assert "Changes that would fit: --zero-stage 3" in capsys.readouterr().err
    assert tool.main("--model-preset 13b --tp 3 --dp 1".split()) == 2  # 40 heads % 3


def _doc_rows(doc: str, first_cell: str) -> list[list[str]]:
    """The cells of the markdown table rows of ``doc`` whose first cell starts with ``first_cell``."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")]
            for line in (ROOT / "docs" / doc).read_text(encoding="utf-8").splitlines() if line.startswith("|")]
    return [r for r in rows if r[0].startswith(first_cell)]


def _offload_rows() -> list[list[str]]:
    """docs/memory.md's offload table: a row per setting, its first cell the variables it sets (or none)."""
    return _doc_rows("memory.md", "`OFFLOAD") + _doc_rows("memory.md", "none")


def _row_env(first_cell: str) -> dict:
    return dict(kv.split("=") for kv in first_cell.strip("`").split()) if first_cell != "none" else {}


REHEARSALS = [("tp4pp8z1", "0,28"), ("tp4z3", "0")]
DRY_16 = {"DRY_RUN": "1", "NNODES": "2", "REHEARSE": "0", "GPU_MEMORY_GB": None}  # the plan (the rehearsal: below)
DRY_64 = {"NNODES": "8", "REHEARSE": "0"}  # with --dry-run (tests/training/test_startup.py reads the same run)


def _script_jobs(tests: set[str]) -> dict[str, tuple[list[str], dict, int]]:
    """The runs of the script that the named tests of this module check: name -> (arguments, the environment's
    changes (None removes a variable), timeout in s)."""
    jobs = {}
    if "test_13b_script_dry_run_fits_and_counts_parameters" in tests:
        jobs["dry_16"] = ([], DRY_16, 120)
    if "test_13b_script_dry_run_refuses_small_gpu" in tests:
        jobs["dry_16_gpu_8"] = ([], {**DRY_16, "GPU_MEMORY_GB": "8"}, 120)
    if "test_the_13b_dry_run_is_one_plan_with_the_figures_the_docs_quote" in tests:
        jobs["dry_64"] = (["--dry-run"], DRY_64, 300)
        for first, *_ in _offload_rows():
            if _row_env(first):  # the row without offload reads the plain run's plan
                jobs[f"dry_64 {first}"] = ([], {"DRY_RUN": "1", **DRY_64, **_row_env(first)}, 300)
    if "test_13b_script_rehearsal_agrees_with_the_plan" in tests:
        for layout, ranks in REHEARSALS:
            jobs[f"rehearse {layout}"] = ([], {"DRY_RUN": "rehearse", "NNODES": "4", "LAYOUT": layout,
                                               "REHEARSE_MICRO_BATCHES": "8", "REHEARSE_RANKS": ranks}, 300)
    return jobs


@pytest.fixture(scope="module")
def script_runs(request):
    """The script's runs that this session's tests of this module check, all started at once in the background
    (tests/background.py; name -> future of the finished process)."""
    tests = {getattr(item, "originalname", "") for item in request.session.items
             if getattr(item, "module", None) is request.module}
    return {name: background.run(["bash", str(SCRIPT), *argv], changes, timeout)
            for name, (argv, changes, timeout) in _script_jobs(tests).items()}


def test_13b_script_dry_run_fits_and_counts_parameters(script_runs):
    r = script_runs["dry_16"].result()
    assert r.returncode == 0, r.stdout + r.stderr
    printed = int(re.search(r"parameters: ([\d,]+)", r.stdout).group(1).replace(",", ""))
    l, h, s = 40, 5120, 2048
    planned = gpt_preset("13b", vocab_padding_tp=4)  # the script's tp 4 pads as Megatron: 50688 rows
    v = planned.padded_vocab_size
    assert v == 50688
    closed = 12 * l * h * h * (1 + 13 / (12 * h) + (v + s) / (12 * l * h))  # Narayanan et al. 2021
    assert printed == num_parameters(planned) == 12_853_626_880 + (50688 - 50304) * h == 12_855_592_960
    assert printed - closed == pytest.approx(2 * h)  # the formula leaves out the final LayerNorm
    assert "world 16 = tp 4 x pp 1 x dp 4, ZeRO stage 3" in r.stdout
    for row in ("weights", "gradients", "optimizer states", "activations", "FLOPs per iteration"):
        assert row in r.stdout


def test_13b_script_dry_run_refuses_small_gpu(script_runs):
    r = script_runs["dry_16_gpu_8"].result()
    assert r.returncode != 0 and "GiB more than the 8 GiB available" in r.stderr


def _dry_run_64(script_runs, first_cell: str = "") -> str:
    r = script_runs[f"dry_64 {first_cell}" if first_cell else "dry_64"].result()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return r.stdout


def _gib(text: str, row: str) -> str:
    return re.search(rf"^  {row} +([\d.]+)$", text, re.M).group(1)


def test_the_13b_dry_run_is_one_plan_with_the_figures_the_docs_quote(script_runs):
    """NNODES=8 REHEARSE=0 --dry-run (64 GPUs): the plan's table and the layouts' comparison total the
    same for the chosen layout, and docs/parallelism.md's 13B table and docs/memory.md's offload table
    quote what the dry run prints (each offload row: the variables its first cell names)."""
    out = _dry_run_64(script_runs)
    plan, compare = out[:out.index("layouts compared")], out[out.index("layouts compared"):]
    cols = {line[:34].strip(): line[34:].split() for line in compare.splitlines() if line.startswith("  ")}
    assert cols["total memory (GiB)"][0] == _gib(plan, "total")
    assert cols["total with NCCL (GiB)"][0] == _gib(plan, "total with NCCL")
    (total,) = _doc_rows("parallelism.md", "total")
    assert total[1:] == [f"{cols['total memory (GiB)'][0]} GiB", f"{cols['total memory (GiB)'][1]} GiB"]
    (sent,) = _doc_rows("parallelism.md", "sent per step: total")
    assert [float(c.split()[0].replace(",", "")) for c in sent[1:]] == [
        round(float(v)) for v in cols["sent per step (GiB)"]]
    rows = _offload_rows()
    assert len(rows) == 4
    for first, per_gpu, host, nvme in rows:
        env = _row_env(first)
        text = _dry_run_64(script_runs, first) if env else plan
        planned = text[:text.index("layouts compared")] if "layouts compared" in text else text
        assert per_gpu == f"{_gib(planned, 'total')} GiB", first
        assert host.split(" (")[0] == (f"{_gib(planned, 'host total')} GiB" if "host total" in planned else "—"), first
        files = sum(float(v) for v in re.findall(r"^  NVMe files, \w+ +([\d.]+)$", planned, re.M))
        assert nvme == (f"{files:.2f} GiB" if files else "—"), first


@pytest.mark.parametrize("layout,ranks", REHEARSALS)
def test_13b_script_rehearsal_agrees_with_the_plan(script_runs, layout, ranks):
    """The dry run's rehearsal mode runs tools/rehearse.py on the script's own 13B arguments (8
    micro-batches per iteration: the same peak as 512, at pp 8 a stage holds at most 8): the first
    and last pipeline stage (tp4pp8z1 on 32 GPUs, dp 1) and a DP rank of tp4z3 (all alike), each
    beside the plan, which agrees within 10% on the peak and 2% on the state."""
    r = script_runs[f"rehearse {layout}"].result()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.findall(r"^rank (\d+) ", r.stdout, re.M) == ranks.split(","), r.stdout
    ratios = re.findall(r"rehearsed / plan: state ([\d.]+)x, peak ([\d.]+)x", r.stdout)
    assert len(ratios) == len(ranks.split(",")), r.stdout
    for state, peak in ratios:
        assert float(state) == pytest.approx(1.0, abs=0.02) and float(peak) == pytest.approx(1.0, abs=0.10), r.stdout


# --- what a GPU run adds: NCCL communicators and pinned rounding (observe/gpu_overheads.py) -----

def test_nccl_estimate_per_communicator_from_nccls_defaults():
    from megazero.observe.gpu_overheads import NCCL_COMMUNICATOR_BYTES

    # 32 channels x one ring connection x (SIMPLE 4 MiB + LL 512 KiB + LL128 120 x 640 x 8 x 8 B)
    assert NCCL_COMMUNICATOR_BYTES == 32 * (4 * 2 ** 20 + 512 * 2 ** 10 + 4_915_200) == 308_281_344


def test_planner_counts_the_communicators_of_a_small_layout():
    from megazero.observe.gpu_overheads import NCCL_COMMUNICATOR_BYTES

    cfg = gpt_preset("tiny", vocab_size=1000)
    plan = dict(micro_batch_size=2, seq_length=64, precision="bf16")
    # tp 2 x dp 2, ZeRO-3: the default group, tp, dp and model-parallel (= tp here, its own group);
    # on NCCL the gradient reduce-scatters share the DP communicator.
    est = estimate_memory(cfg, tp=2, dp=2, zero_stage=3, **plan)
    assert est.nccl_communicators == {"world": 1, "tp": 1, "dp": 1, "mp": 1}
    assert est.nccl == 4 * 308_281_344 == 4 * NCCL_COMMUNICATOR_BYTES
    assert est.device_total == est.total + 1_233_125_376
    text = est.to_text(80)
    assert "NCCL communicators: 4 x ~294 MiB (estimate) = 1176 MiB per GPU (world, tp, dp, mp;" in text
    assert "share the DP communicator on NCCL: 0 more" in text
    # tp 2 x pp 2 x dp 2: a first stage also joins pp and the embedding group (first + last stage).
    piped = estimate_memory(cfg, tp=2, dp=2, pp=2, zero_stage=1, global_batch_size=8, **plan)
    assert piped.nccl_communicators == {"world": 1, "tp": 1, "dp": 1, "pp": 1, "mp": 1, "embedding": 1}
    assert piped.nccl == 6 * 308_281_344
    # One rank: no communicator moves anything.
    alone = estimate_memory(cfg, tp=1, dp=1, zero_stage=3, **plan)
    assert alone.nccl == 0 and alone.device_total == alone.total
    assert "NCCL communicators: 0 x ~294 MiB (estimate) = 0 MiB per GPU (none: one rank;" in alone.to_text()


def test_fit_verdict_includes_the_nccl_estimate():
    cfg = gpt_preset("tiny", vocab_size=1000)
    est = estimate_memory(cfg, tp=2, dp=2, zero_stage=3, micro_batch_size=2, seq_length=64)
    assert est.total < 2 ** 30 < est.device_total
    assert not est.fits(1.0) and est.fits(2.0)
    assert "does NOT fit" in est.to_text(1.0)


def test_gradient_communicator_counted_as_the_engine_decides():
    from megazero.observe.gpu_overheads import creates_gradient_communicator, nccl_communicators

    assert not creates_gradient_communicator(3, 4)  # native collectives, NCCL's path: the DP communicator
    assert creates_gradient_communicator(3, 4, collectives="emulated")  # a second one over the same ranks
    assert not creates_gradient_communicator(3, 4, keep_gathered=True, collectives="emulated")
    assert not creates_gradient_communicator(2, 4, collectives="emulated")
    assert not creates_gradient_communicator(3, 1, collectives="emulated")
    assert nccl_communicators(tp=1, pp=1, dp=4, zero_stage=3, collectives="emulated") == \
        {"world": 1, "dp": 1, "dp_grads": 1}
    # A middle pipeline stage is in no embedding group; a one-rank group is not a communicator.
    assert nccl_communicators(tp=1, pp=4, dp=1, zero_stage=1, pp_rank=1) == {"world": 1, "pp": 1, "mp": 1}


def test_pinned_rounding_and_the_exact_offload_note():
    from megazero.observe.gpu_overheads import caching_host_allocator_bytes, loader_pinned_bytes

    assert caching_host_allocator_bytes(1_100_000_000) == 2 ** 31  # a 1.1 GB request holds 2 GiB
    assert caching_host_allocator_bytes(4096) == 4096 and caching_host_allocator_bytes(0) == 0
    # [2, 65] int64 = 1040 B -> 2048 B; the batch being copied and the next; two more per worker
    assert loader_pinned_bytes(2, 64) == 2 * 2048 and loader_pinned_bytes(2, 64, num_workers=2) == 6 * 2048
    cfg = gpt_preset("tiny", vocab_size=1000)
    est = estimate_memory(cfg, tp=1, dp=2, zero_stage=3, micro_batch_size=2, seq_length=64,
                          offload_optimizer="cpu", offload_param="cpu")
    assert est.host_pinned_batches == 4096
    text = est.to_text()
    assert "host memory of the offloads is exact: one exact-size allocation per offload object, pinned by " \
           "cudaHostRegister" in text
    assert "pinned loader batches: 4,096 bytes of host memory" in text
