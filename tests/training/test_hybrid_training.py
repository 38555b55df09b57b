"""pretrain_gpt.py (and pretrain_mamba.py, the same entry point) training hybrid models with Megatron's flags,
compared with the one-process run of the same command: per-iteration loss and grad norm within 2e-5 (fp32).

Two models: Qwen3-Next's (Gated DeltaNet in 3 of 4 layers beside gated attention, a mixture of experts with a
gated shared expert, RMSNorm as x(1+w), RoPE on a quarter of each head) and Nemotron-H's (``--hybrid-layer-pattern``
with Mamba-2, Gated DeltaNet, attention, MLP and mixture-of-experts layers, each its own block; ``|`` cuts it
for the pipeline). Layouts: tensor + sequence parallelism, pipeline stages from the pattern's cuts, expert
parallelism, ZeRO-3, recompute, and context parallelism (2 and 4 ranks, every exchange) whose recurrent layers
pass state; packed documents reset the state at every boundary."""

from __future__ import annotations

import pytest

from tests.training.test_layout_invariance import assert_same_run, data, flags, launch  # noqa: F401

QWEN3_NEXT = ("--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "4",
              "--linear-num-key-heads", "2", "--linear-num-value-heads", "4", "--linear-key-head-dim", "8",
              "--linear-value-head-dim", "8", "--linear-conv-kernel-dim", "4", "--attention-output-gate",
              "--qk-layernorm", "--apply-layernorm-1p", "--normalization", "RMSNorm", "--swiglu",
              "--disable-bias-linear", "--position-embedding-type", "rope", "--rotary-percent", "0.25",
              "--num-query-groups", "2", "--kv-channels", "16", "--num-experts", "4", "--moe-router-topk", "2",
              "--moe-ffn-hidden-size", "16", "--moe-shared-expert-intermediate-size", "16", "--moe-shared-expert-gate")
NEMOTRON_H = ("--hybrid-layer-pattern", "MG|*E", "--mamba-num-heads", "4", "--mamba-head-dim", "8",
              "--mamba-state-dim", "8", "--mamba-num-groups", "2", "--linear-num-key-heads", "2",
              "--linear-num-value-heads", "2", "--linear-key-head-dim", "8", "--linear-value-head-dim", "8",
              "--squared-relu", "--normalization", "RMSNorm", "--disable-bias-linear", "--position-embedding-type",
              "none", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "16")
DOCUMENTS = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")
LONGER = ("--seq-length", "32", "--max-position-embeddings", "32")  # cp 4: zigzag chunks of 4 tokens
MODELS = {"qwen3_next": QWEN3_NEXT, "nemotron_h": NEMOTRON_H}


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("hybrid1")
    return {name: launch(1, flags(data, *model), out, f"hybrid1_{name}") for name, model in MODELS.items()}


@pytest.mark.parametrize("model,world,extra", [
    ("qwen3_next", 2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    ("qwen3_next", 4, ["--tp", "2", "--sequence-parallel", "--pipeline-model-parallel-size", "2"]),
    ("qwen3_next", 4, ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--expert-model-parallel-size", "2",
                       "--zero-stage", "3"]),
    ("nemotron_h", 2, ["--pipeline-model-parallel-size", "2"]),  # the pattern's cut: MG | *E
    ("nemotron_h", 4, ["--tp", "2", "--sequence-parallel", "--context-parallel-size", "2", "--cp-comm-type",
                       "allgather", "--recompute-granularity", "full"]),
    ("nemotron_h", 4, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2", "--zero-stage", "2",
                       "--pipeline-model-parallel-size", "2"]),
    ("nemotron_h", 2, ["--context-parallel-size", "2", "--linear-cp-comm-type", "a2a"]),  # Megatron's heads a2a
    ("qwen3_next", 4, ["--context-parallel-size", "2", "--linear-cp-comm-type", "a2a", "--zero-stage", "1"]),
])
def test_hybrids_equal_one_process(data, one_process, tmp_path, model, world, extra):  # noqa: F811
    got = launch(world, flags(data, *MODELS[model], *extra), tmp_path, f"hybrid_{model}_{world}")
    assert_same_run(got, one_process[model], what=f"{model}, world {world} {extra}")


@pytest.mark.parametrize("model", ["qwen3_next", "nemotron_h"])
def test_packed_documents_under_context_parallelism_of_4_equal_one_process(data, tmp_path, model):  # noqa: F811
    """Documents reset the state and the convolution; cp 4 cuts chunks of 4 tokens, so document ends fall on
    and between the shards' cuts; the ring and the all-to-all each take the documents their way."""
    args = flags(data, *MODELS[model], *DOCUMENTS, *LONGER)
    one = launch(1, args, tmp_path, f"hybrid_docs_{model}_1")
    comm = "p2p" if model == "qwen3_next" else "a2a"
    got = launch(4, args + ["--context-parallel-size", "4", "--cp-comm-type", comm], tmp_path, f"hybrid_docs_{model}_4")
    assert_same_run(got, one, what=f"{model} with documents, cp 4 {comm}")


def test_multi_token_prediction_on_a_hybrid_equals_one_process(data, tmp_path):  # noqa: F811
    """An MTP depth after Qwen3-Next's stack (attention and the model's mixture of experts), at pp 2 x cp 2."""
    args = flags(data, *QWEN3_NEXT, "--mtp-num-layers", "1")
    one = launch(1, args, tmp_path, "hybrid_mtp_1")
    got = launch(4, args + ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2"], tmp_path,
                 "hybrid_mtp_4")
    assert_same_run(got, one, what="Qwen3-Next with MTP, pp 2 x cp 2")


def test_pretrain_mamba_py_runs_megatrons_mamba_launch_line(data, one_process, tmp_path):  # noqa: F811
    """``torchrun pretrain_mamba.py`` (Megatron-LM's hybrid entry point) with Megatron's ``--spec ...
    mamba_stack_spec`` and ``--num-layers`` left out (the pattern gives it), at cp 2: the run of pretrain_gpt.py in
    one process; its start-up line names the layers."""
    import json
    import os

    from tests.launch import launch as run_script

    args = flags(data, *NEMOTRON_H, "--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec",
                 "--context-parallel-size", "2")
    at = args.index("--num-layers")
    args = args[:at] + args[at + 2:]
    metrics = os.path.join(str(tmp_path), "mamba_entry.jsonl")
    run = run_script(2, [*args, "--metrics-file", metrics], script="pretrain_mamba.py", cwd=tmp_path).check("mamba_entry")
    assert "hybrid: 4 layers MG|*E (1 Mamba-2, 1 Gated DeltaNet, 1 attention, 1 MoE)" in run.stdout + run.stderr
    got = {r["iteration"]: r for r in map(json.loads, open(metrics)) if "lm_loss" in r}
    assert_same_run(got, one_process["nemotron_h"], what="pretrain_mamba.py at cp 2")


def test_a_heads_all_to_all_the_heads_do_not_allow_is_refused_before_any_process_group(data):  # noqa: F811
    from megazero.config.arguments import ConfigError, parse_args

    argv = flags(data, *QWEN3_NEXT, "--tp", "2", "--context-parallel-size", "2", "--linear-cp-comm-type", "a2a")
    with pytest.raises(ConfigError, match="splits each tensor-parallel rank's 1 key heads"):
        parse_args(argv, 4, check_files=False)


@pytest.mark.parametrize("fmt", ["megazero", "torch_dist"])
def test_a_hybrid_checkpoint_resumes_at_other_layouts(data, one_process, tmp_path, fmt):  # noqa: F811
    """Saved at tp 2 (Megatron's torch_dist is its default format), resumed in one process and at pp 2 x cp 2:
    the run goes on as the uninterrupted one."""
    from tests.training.test_layout_invariance import assert_resumes_elsewhere

    assert_resumes_elsewhere(data, [*NEMOTRON_H, "--ckpt-format", fmt], (2, ["--tp", "2"]),
                             [(1, []), (4, ["--pp", "2", "--context-parallel-size", "2"])], one_process["nemotron_h"],
                             tmp_path, f"hybrid_{fmt}")
