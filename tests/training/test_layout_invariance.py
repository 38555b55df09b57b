"""The parallel layout never changes the model: what a user runs, compared with the one-process run.

Every run here is pretrain_gpt.py with a user's flags, on as many ranks as ``torchrun
--nproc_per_node N`` would start (``tests/launch.py``: its ``main(argv)`` on the test pool's ranks;
the failure cases start the real ``torchrun``), reading back what the run wrote: the
per-iteration loss and grad norm from ``--metrics-file`` and the weights from ``--save``.
fp32 with dropout 0, so the layouts must agree to float rounding (2e-5 relative):

* pp 2, pp 4 (untied), pp 2 x dp 2 ZeRO-3 with both ZeRO-3 x PP policies, tp 2 x pp 2
  interleaved with sequence parallelism, pp 2 with ramp-up and fp16, pp 2 with per-document
  positions / masks / loss mask, pp 2 from --pretrained-checkpoint, bf16 pp 2 (bf16 tolerance);
* the initial weights (saved after the first step, at lr 0) are bit-identical at pp 1, pp 2, pp 4,
  pp 2 x dp 2 ZeRO-3 and tp 2 x pp 2 x v 2 (read back through the checkpoint reader the export tools use);
* a checkpoint saved at three layouts resumes at three others with the reference's next losses.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.helpers import VOCAB, write_documents, write_progressions
from tests.launch import Run, in_pool
from tests.launch import launch as start

ITERS = 4
RTOL = 2e-5


def write_corpus(directory) -> str:
    """Short documents (several per sample, so the per-document flags have work) as .bin/.idx."""
    return write_progressions(str(directory / "docs_text_document"), 300, (3, 12), seed=3)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("layout_data"))


def flags(prefix: str, *extra: str, layers: int = 4, iters: int = ITERS) -> list[str]:
    return ["--num-layers", str(layers), "--hidden-size", "32", "--num-attention-heads", "4",
            "--seq-length", "16", "--max-position-embeddings", "16", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--train-iters", str(iters), "--lr", "5e-3", "--min-lr", "1e-4",
            "--lr-decay-style", "cosine", "--lr-warmup-iters", "1", "--hidden-dropout", "0",
            "--attention-dropout", "0", "--seed", "11", "--data-path", prefix, "--split", "98,2,0",
            "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB), "--make-vocab-size-divisible-by", "32",
            "--log-interval", "1", "--eval-iters", "0", "--clip-grad", "1.0", *extra]


def run_cli(world: int, args: list[str], out_dir, metrics: str, timeout: float = 300) -> Run:
    """pretrain_gpt.py started as a user starts it: ``torchrun --nproc_per_node world`` (plain python for 1)."""
    return start(world, [*args, "--metrics-file", metrics], cwd=out_dir, timeout_s=timeout)


def launch(world: int, args: list[str], out_dir, name: str) -> dict[int, dict]:
    """pretrain_gpt.py's main(args) on ``world`` ranks (the program torchrun would start, in the test
    pool); returns {iteration: metrics record}."""
    metrics = os.path.join(str(out_dir), f"{name}.jsonl")
    run = in_pool(world, [*args, "--metrics-file", metrics], cwd=out_dir).check(name)
    with open(os.path.join(str(out_dir), f"{name}.log"), "w") as f:  # what the user saw, for the tests to read
        f.write(run.stdout + run.stderr)
    records = {}
    if os.path.exists(metrics):
        for line in open(metrics):
            rec = json.loads(line)
            if "lm_loss" in rec:
                records[rec["iteration"]] = rec
    return records


def assert_same_run(got: dict, ref: dict, rtol: float = RTOL, what: str = "") -> None:
    assert sorted(got) == sorted(ref), (what, sorted(got), sorted(ref))
    for it in ref:
        for key in ("lm_loss", "grad_norm"):
            a, b = got[it][key], ref[it][key]
            assert abs(a - b) <= rtol * abs(b), f"{what}: iteration {it} {key} {a} vs one process {b}"


def assert_resumes_elsewhere(data_prefix: str, model: list, saved_at: tuple[int, list], resumed_at: list,
                             reference: dict, tmp_path, name: str) -> None:
    """Train with ``model`` flags at ``saved_at`` = (world, flags), saving every iteration; resume from
    iteration 2 at each (world, flags) of ``resumed_at``: iterations 3 on equal ``reference``'s."""
    saved = str(tmp_path / f"{name}_ckpt")
    world, extra = saved_at
    launch(world, flags(data_prefix, *model, *extra, "--save", saved, "--save-interval", "1"), tmp_path, f"{name}_save")
    tail = {it: r for it, r in reference.items() if it > 2}
    for world, extra in resumed_at:
        got = launch(world, flags(data_prefix, *model, *extra, "--load", saved, "--ckpt-step", "2"), tmp_path,
                     f"{name}_resumed_{world}")
        assert_same_run(got, tail, what=f"{name}: saved at {saved_at}, resumed at world {world} {extra}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("layout_runs")


@pytest.fixture(scope="module")
def reference(data, runs):
    """The one-process runs the layouts are compared with, saved every iteration (iteration 1: the
    initial weights; iteration 2: where the resume test starts)."""
    return {
        "tied": launch(1, flags(data, "--save", str(runs / "ref_tied"), "--save-interval", "1"), runs, "ref_tied"),
        "untied": launch(1, flags(data, "--untie-embeddings-and-output-weights", "--save", str(runs / "ref_untied"),
                                  "--save-interval", "1"), runs, "ref_untied"),
    }


LAYOUTS = {
    "pp2": (2, ["--pp", "2"], "tied"),
    "pp4_untied": (4, ["--pp", "4", "--untie-embeddings-and-output-weights"], "untied"),
    "pp2_dp2_z3": (4, ["--pp", "2", "--zero-stage", "3"], "tied"),
    "tp2_pp2_v2_sp": (4, ["--tp", "2", "--pp", "2", "--virtual-pipeline-model-parallel-size", "2",
                          "--sequence-parallel"], "tied"),
}


@pytest.fixture(scope="module")
def layouts(data, runs):
    """Each layout's run, saved every iteration (see ``reference``; the resume test reloads them elsewhere)."""
    return {name: launch(world, flags(data, *extra, "--save", str(runs / name), "--save-interval", "1"), runs, name)
            for name, (world, extra, _) in LAYOUTS.items()}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_layout_matches_one_process(layouts, reference, name):
    assert_same_run(layouts[name], reference[LAYOUTS[name][2]], what=name)


def test_pp2_dp2_zero3_keep_gathered_policy(data, runs, reference):
    ds = runs / "keep_gathered.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "stage3_keep_gathered_in_step": True}}))
    got = launch(4, flags(data, "--pp", "2", "--zero-stage", "3", "--deepspeed_config", str(ds)), runs, "keep")
    assert_same_run(got, reference["tied"], what="pp2 x dp2 ZeRO-3 keep-gathered")


@pytest.mark.parametrize("name,world,extra,rtol", [
    # Ramp-up 2 -> 8 samples over 8 samples: 1, 2, then 4 micro-batches per step through the pipeline.
    ("rampup_fp16", 2, ["--rampup-batch-size", "2", "2", "8", "--fp16", "--initial-loss-scale", "1024"], RTOL),
    ("documents", 2, ["--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss"], RTOL),
    ("bf16", 2, ["--bf16"], 2e-2),
])
def test_pp2_flags_match_one_process(data, runs, name, world, extra, rtol):
    ref = launch(1, flags(data, *extra), runs, f"{name}_ref")
    got = launch(world, flags(data, "--pp", str(world), *extra), runs, f"{name}_pp2")
    assert_same_run(got, ref, rtol=rtol, what=name)


def test_pp2_from_pretrained_checkpoint(data, runs, reference):
    """--pretrained-checkpoint at pp 2 starts from the file's weights, as at pp 1."""
    from safetensors.torch import save_file
    from megazero.checkpoint.native import load_full_model

    _, weights, _ = load_full_model(str(runs / "ref_tied"), 2)  # a trained model as the "pretrained" one
    pre = runs / "pretrained"
    pre.mkdir(exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(pre / "model_full.safetensors"))
    ref = launch(1, flags(data, "--pretrained-checkpoint", str(pre)), runs, "pre_ref")
    got = launch(2, flags(data, "--pp", "2", "--pretrained-checkpoint", str(pre)), runs, "pre_pp2")
    assert_same_run(got, ref, what="pretrained pp2")
    assert abs(ref[1]["lm_loss"] - reference["tied"][1]["lm_loss"]) > 1e-3  # the file was used, not the seed


def test_initial_weights_bit_identical_across_layouts(runs, reference, layouts):
    from megazero.checkpoint.native import load_full_model

    # The first step of the linear warmup from --lr-warmup-init 0 (the default) runs at lr 0 and leaves
    # every weight bit-identical (Adam adds 0, decay multiplies by 1): each run's checkpoint of iteration 1
    # holds its initial weights, written as every layout writes its checkpoints.
    assert "--lr-warmup-init" not in flags("x") and "--lr-warmup-iters" in flags("x")
    refs = {kind: load_full_model(str(runs / f"ref_{kind}"), 1)[1] for kind in ("tied", "untied")}
    assert any(not torch.equal(refs["tied"][k], v) for k, v in load_full_model(str(runs / "ref_tied"), 2)[1].items())
    for name, (_, _, kind) in LAYOUTS.items():
        _, w, _ = load_full_model(str(runs / name), 1)
        ref = refs[kind]
        assert sorted(w) == sorted(ref), name
        for k in ref:
            assert torch.equal(w[k], ref[k]), f"{name}: {k} differs from pp 1 at initialization"


def test_checkpoints_resume_across_layouts(data, runs, reference, layouts):
    """Saved at iteration 2 by pp 1 (one process), pp 2 x dp 2 ZeRO-3 and tp 2 x pp 2 x v 2; each resumes at
    another layout, and iterations 3-4 equal the uninterrupted one-process run."""
    resumes = [("ref_tied", 4, ["--tp", "2", "--pp", "2"]),
               ("pp2_dp2_z3", 1, []),
               ("tp2_pp2_v2_sp", 4, ["--pp", "4", "--zero-stage", "2"])]
    for source, world, extra in resumes:
        got = launch(world, flags(data, *extra, "--load", str(runs / source), "--ckpt-step", "2"), runs,
                     f"resume_{source}")
        tail = {it: r for it, r in reference["tied"].items() if it > 2}
        assert_same_run(got, tail, what=f"{source} resumed at {extra or 'pp 1'}")


def test_pp2_logging_flags_match_one_process(data, runs):
    """--log-params-norm, --log-num-zeros-in-grad and DeepSpeed's wall_clock_breakdown at pp 2, as at pp 1
    (they were silently dropped by the old pipeline loop)."""
    ds = runs / "wall_clock.json"
    ds.write_text(json.dumps({"wall_clock_breakdown": True}))
    extra = ["--log-params-norm", "--log-num-zeros-in-grad", "--deepspeed_config", str(ds)]
    ref = launch(1, flags(data, *extra, iters=2), runs, "logflags_ref")
    got = launch(2, flags(data, "--pp", "2", *extra, iters=2), runs, "logflags_pp2")
    assert_same_run(got, ref, what="logging flags pp2")
    for it in ref:
        assert got[it]["params_norm"] == pytest.approx(ref[it]["params_norm"], rel=RTOL)
        assert got[it]["num_zeros"] == ref[it]["num_zeros"]
        assert {"fwd_ms", "bwd_ms", "step_ms"} <= set(got[it]), sorted(got[it])


def test_uneven_pipeline_split_matches_one_process(data, runs):
    """5 layers over pp 2 with --decoder-first-pipeline-num-layers 2 (stages of 2 and 3 layers): the
    second stage's layers are the model's 2-4, by name and by value."""
    ref = launch(1, flags(data, layers=5, iters=2), runs, "uneven_ref")
    got = launch(2, flags(data, "--pp", "2", "--decoder-first-pipeline-num-layers", "2", layers=5, iters=2),
                 runs, "uneven_pp2")
    assert_same_run(got, ref, what="uneven pp2")


def test_bad_token_at_pp2_stops_every_rank_with_one_message(runs):
    """A token outside the vocabulary, read by every rank at pp 2: all ranks stop promptly (no rank left in
    a collective), exit non-zero, and the message names the dataset and the document."""
    rng = np.random.default_rng(5)
    docs = [np.append(rng.integers(0, VOCAB, 12), VOCAB) for _ in range(80)]
    docs[5][2] = VOCAB + 9
    prefix = write_documents(str(runs / "bad_text_document"), docs)
    proc = run_cli(2, flags(prefix, "--pp", "2", iters=3), runs, str(runs / "bad.jsonl"), timeout=120)
    assert proc.returncode != 0
    assert "document 5 holds token id 129" in proc.stderr, proc.stderr[-2000:]
    # A user error: one line from one rank, no traceback from megazero; torchrun's summary after it quotes
    # the line from the ranks' error files (its root cause among them).
    ours = proc.stderr.split("Traceback (most recent call last)")[0].split("ChildFailedError")[0]
    assert ours.count("document 5 holds token id 129") == 1, proc.stderr[-2000:]
    assert "document 5 holds token id 129" in proc.stderr.split("Root Cause")[-1], proc.stderr[-2000:]
    assert "megazero/" not in proc.stderr, proc.stderr[-2000:]


def test_generate_prompt_at_pp2_refused_before_any_process_group(data, runs):
    proc = run_cli(2, flags(data, "--pp", "2", "--generate-prompt", "ROMEO:"), runs, str(runs / "gen.jsonl"),
                   timeout=120)
    # Each rank exits 2 at parse time (torchrun reports it as 1, with the ranks' exit codes).
    assert proc.returncode != 0 and "exitcode  : 2" in proc.stderr, proc.stderr[-2000:]
    assert "--generate-prompt with --pp 2" in proc.stderr and "tools/generate.py" in proc.stderr
