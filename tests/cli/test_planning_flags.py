"""tools/estimate_memory.py and tools/rehearse.py take pretrain_gpt.py's flags: the same table, the same
validation (parse_args(planning=True)), the training-only flags optional, a few flags of their own that no
pretrain_gpt.py flag shares; the estimator's earlier spellings still work, each named as pretrain_gpt.py's."""

from __future__ import annotations

import re

import pytest

from megazero.observe.planner import estimate_memory_for
from megazero.config.arguments import build_parser as pretrain_parser
from megazero.config.arguments import parse_args
from tests.cli.programs import program

PLAN = ("--model-preset gpt-13b --tp 4 --zero-stage 3 --micro-batch-size 2 --global-batch-size 1024 --bf16 "
        "--recompute-granularity full --use-flash-attn").split()
TRAINING = "--lr 1e-4 --train-iters 1000 --mock-data --tokenizer-type NullTokenizer --vocab-size 50256".split()


def _estimate(capsys, words: list[str]) -> tuple[int, str, str]:
    code = program("estimate_memory").main(words)
    out, err = capsys.readouterr()
    return code, out, err


def _plan(out: str) -> str:
    """The plan of an output: from the parameter count on (the resolved run above it names the flags)."""
    return out[out.index("parameters:"):]


def _options(p) -> set[str]:
    return {s for a in p._actions for s in a.option_strings}


@pytest.mark.parametrize("name, own", [("estimate_memory", {"--world-size", "--device-memory-gb", "--gpu-memory-gb",
                                                             "--compare"}),
                                        ("rehearse", {"--world-size", "--ranks", "--json", "--device-memory-gb",
                                                      "--gpu-memory-gb", "--micro-batches", "--verbose"})])
def test_a_planning_tool_takes_pretrain_gpts_flags_and_a_few_of_its_own(name, own):
    table = _options(pretrain_parser())
    tool = _options(program(name).build_parser())
    assert tool == table | own
    assert not own & table  # no name in both: the tool tells its own from pretrain_gpt.py's wherever they stand


def test_the_training_only_flags_change_nothing_of_the_plan(capsys):
    """The same plan with and without --lr, --train-iters, data and tokenizer; it is the one parse_args
    resolves for pretrain_gpt.py (start-up's plan)."""
    code, bare, err = _estimate(capsys, ["--world-size", "64", *PLAN])
    assert code == 0 and not err, err
    code, full, _ = _estimate(capsys, ["--world-size", "64", *PLAN, *TRAINING])
    assert code == 0
    assert _plan(bare) == _plan(full)
    assert "lr:" not in bare and "lr: 0.0001" in full  # no placeholder shown as the run's
    assert "planning without --lr, --train-iters, --data-path" in bare
    code, split, _ = _estimate(capsys, ["--world-size", "64", *PLAN, "--split", "949,50,1"])  # of no data: no matter
    assert code == 0 and _plan(split) == _plan(bare)
    cfg = parse_args(PLAN + TRAINING, 64, check_files=False)
    assert _plan(full).strip() == _plan(estimate_memory_for(cfg).to_text(80.0)).strip()


@pytest.mark.parametrize("old, new, said", [
    (["--dp", "16"], ["--world-size", "64"], "--dp 16: read as --world-size 64"),
    (["--world-size", "64", "--recompute", "full"], ["--world-size", "64", "--recompute-granularity", "full"],
     "--recompute: read as pretrain_gpt.py's --recompute-granularity"),
    (["--world-size", "64", "--flash-attn"], ["--world-size", "64", "--use-flash-attn"],
     "--flash-attn: read as pretrain_gpt.py's --use-flash-attn"),
    (["--world-size", "64", "--num-heads", "40"], ["--world-size", "64", "--num-attention-heads", "40"],
     "--num-heads: read as pretrain_gpt.py's --num-attention-heads"),
    (["--world-size", "64", "--offload-optimizer", "cpu", "--offload-ratio", "0.5"],
     ["--world-size", "64", "--optimizer-cpu-offload", "--optimizer-offload-fraction", "0.5"],
     "--offload-optimizer cpu: read as pretrain_gpt.py's --optimizer-cpu-offload"),
    (["--world-size", "64", "--grad-accum-dtype", "fp32"], ["--world-size", "64", "--accumulate-allreduce-grads-in-fp32"],
     "read as pretrain_gpt.py's --accumulate-allreduce-grads-in-fp32"),
    (["--world-size", "64", "--train-args"], ["--world-size", "64"], "--train-args is not needed"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_earlier_spellings_plan_alike_and_name_pretrain_gpts_flag(capsys, old, new, said):
    code, before, err = _estimate(capsys, old + PLAN)
    assert code == 0
    assert said in err and len([line for line in err.splitlines() if said in line]) == 1
    code, after, _ = _estimate(capsys, new + PLAN)
    assert code == 0 and _plan(before) == _plan(after)


@pytest.mark.parametrize("words, key", [(["--offload-param", "cpu"], "zero_optimization.offload_param"),
                                         (["--offload-optimizer", "nvme"], "zero_optimization.offload_optimizer"),
                                         (["--grad-accum-dtype", "bf16"], "data_types")])
def test_an_earlier_spelling_pretrain_gpt_reads_from_its_json_is_refused_in_one_line(capsys, words, key):
    code, out, err = _estimate(capsys, ["--world-size", "64", *PLAN, *words])
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and key in err and "--deepspeed-config" in err, err


def test_an_unknown_flag_is_one_line_with_the_closest_ones(capsys):
    code, out, err = _estimate(capsys, ["--world-size", "64", *PLAN, "--zero-stag", "3"])
    assert code == 2 and not out
    assert len(err.strip().splitlines()) == 1 and "did you mean --zero-stage" in err, err
    code, _, err = _estimate(capsys, ["--world-sizes", "64", *PLAN])  # the tool's own flags are among the closest
    assert code == 2 and "did you mean --world-size" in err, err
    code, _, err = _estimate(capsys, PLAN)
    assert code == 2 and err.strip() == "error: give --world-size (the ranks torchrun would start for this launch)"


def test_compare_takes_pretrain_gpts_flags_and_totals_what_the_single_plans_total(capsys):
    """Each column is the plan of the same flags with the layout's after them: its total memory and its
    bytes sent are those tools/estimate_memory.py prints for that layout alone."""
    moe = ("--num-layers 8 --hidden-size 1024 --num-attention-heads 16 --seq-length 4096 --micro-batch-size 1 "
           "--global-batch-size 64 --bf16 --vocab-size 32000 --num-experts 8 --swiglu --attention-dropout 0").split()
    layouts = ["ep8:--expert-model-parallel-size 8", "cp2ep4:--context-parallel-size 2 --ep 4 --zero-stage 3"]
    code, table, err = _estimate(capsys, ["--world-size", "16", *moe, "--compare", *layouts])
    assert code == 0, err
    rows = {line[:34].strip(): line[34:].split() for line in table.splitlines()[1:]}
    for column, layout in enumerate(layouts):
        code, alone, _ = _estimate(capsys, ["--world-size", "16", *moe, *layout.partition(":")[2].split()])
        total = re.search(r"^  total +([\d.]+)$", alone, re.M).group(1)
        assert rows["total memory (GiB)"][column] == total
        sent = re.search(r"sent per GPU per step[^:]*: (.*) \(total ([\d.]+) GiB\)", alone)
        assert rows["sent per step (GiB)"][column] == sent.group(2)
        for label, row in (("expert-parallel all-to-all", "sent, expert all-to-all (GiB)"),
                           ("context parallel", "sent, context parallel (GiB)"),
                           ("expert data parallel", "sent, expert data parallel (GiB)")):
            shown = re.search(label + r" ([\d.]+) GiB", sent.group(1))
            assert rows[row][column] == (shown.group(1) if shown else "0.00"), (layout, row)
    assert float(rows["sent, context parallel (GiB)"][1]) > 0 and float(rows["sent, expert all-to-all (GiB)"][0]) > 0


def test_rehearse_takes_pretrain_gpts_flags_with_or_without_a_separator():
    from megazero.cli.rehearse import _split

    own, train = _split(["--world-size", "8", "--tp", "2", "--ranks", "0,7", "--", "--pp", "2", "--json", "x"])
    assert (own.world_size, own.ranks, own.json) == (8, "0,7", "x")  # told by its name, even after '--'
    assert train == ["--tp", "2", "--pp", "2"]
    own, train = _split(["--tp", "2", "--world-size", "8", "--micro-batches", "2", "--bf16"])
    assert (own.world_size, own.micro_batches, train) == (8, 2, ["--tp", "2", "--bf16"])


def test_estimate_startup_takes_pretrain_gpts_flags_with_or_without_the_earlier_train_args(capsys, monkeypatch):
    import megazero.cli.estimate_startup as tool

    monkeypatch.setattr(tool, "measure_rates", lambda: (1.0, 1e8))  # measured rates: not this test's subject
    outputs = []
    for words in (["--world-size", "64", *PLAN], ["--world-size", "64", "--train-args", *PLAN, *TRAINING]):
        assert tool.main(words) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and "start-up per rank (64 ranks)" in outputs[0]
    assert tool.main(PLAN) == 2 and "give --world-size" in capsys.readouterr().err
