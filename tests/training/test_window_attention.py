"""pretrain_gpt.py with Megatron's sliding-window flags and attention sinks (gpt-oss's attention:
``--window-size L,0 --window-attn-skip-freq 2 --softmax-type learnable``), compared with the one-process
run of the same command: per-iteration loss and grad norm within 2e-5 (fp32) under context parallelism
(every exchange, windows shorter and longer than a zigzag chunk), tensor + sequence parallelism,
pipeline stages and ZeRO-3; the window and the sinks change the losses (they are applied); a
torch_dist checkpoint keeps the sinks across layouts."""

from __future__ import annotations

import pytest

from tests.training.test_layout_invariance import (assert_resumes_elsewhere, assert_same_run, data,  # noqa: F401
                                                   flags, launch)

# seq 16: a zigzag chunk is 4 tokens at cp 2; a window of 2 keys is shorter than it, 6 longer
SHORT = ("--window-size", "2,0", "--window-attn-skip-freq", "2", "--softmax-type", "learnable")
LONG = ("--window-size", "6,0", "--window-attn-skip-freq", "([1]*3+[0])", "--softmax-type", "learnable")
MODEL = ("--num-query-groups", "2", "--position-embedding-type", "rope")


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("window1")
    return {name: launch(1, flags(data, *MODEL, *pattern), out, f"window1_{name}")
            for name, pattern in (("short", SHORT), ("long", LONG), ("none", ()))}


def test_windows_and_sinks_change_the_run(one_process):
    for name in ("short", "long"):
        assert all(abs(one_process[name][it]["lm_loss"] - one_process["none"][it]["lm_loss"]) > 1e-4
                   for it in one_process["none"]), f"the {name} window and the sinks left the losses unchanged"


@pytest.mark.parametrize("pattern,world,extra", [
    ("short", 2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    ("long", 2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    ("short", 2, ["--context-parallel-size", "2", "--cp-comm-type", "a2a"]),
    ("long", 4, ["--context-parallel-size", "2", "--cp-comm-type", "allgather", "--pipeline-model-parallel-size",
                 "2"]),
    ("short", 4, ["--tp", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2",
                  "--recompute-granularity", "selective"]),
    ("short", 4, ["--context-parallel-size", "2", "--zero-stage", "3"]),  # dp 2 x cp 2
    ("long", 4, ["--context-parallel-size", "4", "--cp-comm-type", "a2a+p2p",  # cp 4: chunks of 2 tokens
                 "--hierarchical-context-parallel-sizes", "2", "2"]),
    ("short", 4, ["--context-parallel-size", "4", "--cp-comm-type", "p2p", "--recompute-granularity", "full"]),
])
def test_windows_and_sinks_equal_one_process(data, one_process, tmp_path, pattern, world, extra):  # noqa: F811
    args = flags(data, *MODEL, *(SHORT if pattern == "short" else LONG), *extra)
    got = launch(world, args, tmp_path, f"window_{pattern}_{world}")
    assert_same_run(got, one_process[pattern], what=f"{pattern} window, world {world} {extra}")


def test_a_torch_dist_checkpoint_keeps_the_sinks_across_layouts(data, one_process, tmp_path):  # noqa: F811
    """Saved at tp 2 in Megatron's torch_dist (the sinks as megatron-core's core_attention.softmax_offset, sharded
    by head), resumed in one process and at pp 2 x cp 2: the run goes on as the uninterrupted one."""
    assert_resumes_elsewhere(data, [*MODEL, *SHORT, "--ckpt-format", "torch_dist"], (2, ["--tp", "2"]),
                             [(1, []), (4, ["--pp", "2", "--context-parallel-size", "2"])], one_process["short"],
                             tmp_path, "window_torch_dist")


BASE = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "2", "--lr", "1e-3",
        "--train-iters", "1", "--mock-data", "--vocab-size", "64"]


def test_the_start_up_line_names_the_pattern():
    from megazero.config.arguments import describe, parse_args

    line = describe(parse_args(BASE + list(SHORT), check_files=False)).split("\\n")[0]
    assert "; 2 of 4 layers slide over 3 keys; attention sinks (learnable)" in line, line


@pytest.mark.parametrize("argv,message", [
    (["--window-size", "3,2"], "--window-size 3,0"),  # a causal model sees no key after the query
    (["--window-size", "3,0", "--window-attn-skip-freq", "[1,0,1]"], "one 1 (sliding) or 0 (global) per layer, 4"),
    (["--window-attn-skip-freq", "2"], "without --window-size"),
    (["--window-size=-1,0"], "-1 (unbounded) is no window"),
    (["--softmax-type", "learnable", "--attention-backend", "flash"], "flash-attn's kernels take no sinks"),
    (["--softmax-type", "learnable", "--window-size", "3,0", "--attention-backend", "fused"], None),
])
def test_bad_windows_are_refused_before_any_process_group(argv, message):
    from megazero.config.arguments import ConfigError, parse_args

    if message is None:
        parse_args(BASE + argv, check_files=False)
        return
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        parse_args(BASE + argv, check_files=False)


DOCUMENTS = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")


def test_windows_with_packed_documents_and_multi_token_prediction_equal_one_process(data, tmp_path):  # noqa: F811
    """The pattern with packed documents (the ring cuts its blocks at them, all-to-all takes the mask) and
    an MTP depth, which slides as the last layer does."""
    args = flags(data, *MODEL, *LONG, *DOCUMENTS, "--mtp-num-layers", "1")
    one = launch(1, args, tmp_path, "window_docs_1")
    for world, extra in ((2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
                         (4, ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--pp", "2"])):
        got = launch(world, args + extra, tmp_path, f"window_docs_{world}")
        assert_same_run(got, one, what=f"documents + MTP, world {world} {extra}")


KEYED = ("--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--dropout-rng", "position")


def test_keyed_dropout_with_windows_equals_one_process_through_the_halo_exchange(data, tmp_path):  # noqa: F811
    """Attention dropout keyed by position on the window's blocks: the halo exchange (cp 2, a window of 2 keys)
    and all-to-all apply the one-process run's masks."""
    args = flags(data, *MODEL, *SHORT, *KEYED)
    one = launch(1, args, tmp_path, "window_keyed_1")
    for comm in ("p2p", "a2a"):
        got = launch(2, args + ["--context-parallel-size", "2", "--cp-comm-type", comm], tmp_path, f"window_keyed_{comm}")
        assert_same_run(got, one, what=f"keyed dropout with windows, cp 2 {comm}")


def test_megatron_lm_arguments_carry_the_window_and_the_sinks_both_ways():
    """A torch_dist save writes Megatron-LM's window_size, window_attn_skip_freq and softmax_type (and YaRN's
    rounding); reading them gives the same model; Megatron's window of -1 (unbounded) is none."""
    import argparse

    from megazero.config.arguments import parse_args
    from megazero.model.interop.megatron_args import megatron_model_args
    from megazero.model.interop.megatron_import import config_from_megatron_args

    model = parse_args(BASE + list(LONG) + ["--position-embedding-type", "yarn", "--rotary-scaling-factor", "4",
                                           "--no-yarn-correction-range-round-to-int"], check_files=False).model
    args = megatron_model_args(model)
    assert (args["window_size"], args["window_attn_skip_freq"], args["softmax_type"]) == ((6, 0), [1, 1, 1, 0],
                                                                                          "learnable")
    back = config_from_megatron_args(argparse.Namespace(**args))
    assert (back.window_size, back.window_attn_skip_freq, back.softmax_type, back.yarn_correction_range_round_to_int) \
        == ((6, 0), (1, 1, 1, 0), "learnable", False)
    unbounded = config_from_megatron_args(argparse.Namespace(**{**args, "window_size": (-1, -1)}))
    assert unbounded.window_size is None and unbounded.window_attn_skip_freq is None
