"""pretrain_gpt.py with a mixture of experts (--num-experts) at several expert-parallel layouts, compared
with the one-process run of the same flags: loss and grad norm per iteration within 2e-5 (fp32, dropout 0),
the load-balancing and z losses on; and the refusals at parse time."""

from __future__ import annotations

import pytest

from megazero.config.arguments import parse_args
from megazero.config.train_config import ConfigError
from tests.training.test_layout_invariance import (assert_resumes_elsewhere, assert_same_run, data, flags,  # noqa: F401
                                                   launch)

MOE = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "48", "--disable-bias-linear",
       "--swiglu", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001", "--moe-layer-freq", "2")


@pytest.fixture(scope="module")
def one_process_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("moe1")


@pytest.fixture(scope="module")
def one_process(data, one_process_dir):  # noqa: F811
    # with TensorBoard's tags, read by test_tensorboard_gets_the_log_lines_figures
    return launch(1, flags(data, *MOE, "--tensorboard-dir", "tb", "--log-throughput", "--log-memory-to-tensorboard"),
                  one_process_dir, "moe1")


def test_tensorboard_gets_the_log_lines_figures(one_process, one_process_dir):
    # pretrain_gpt.py's event file, read by TensorBoard's own reader: the mixture's statistics by default, the
    # throughput and memory as --log-throughput and --log-memory-to-tensorboard ask, each as its metrics record says
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(one_process_dir / "tb"))
    events.Reload()
    for tag, key, unit in (("moe aux loss", "moe_aux_loss", 1), ("expert load max over mean", "expert_load_max_over_mean", 1),
                           ("throughput", "tflops_per_rank", 1), ("tokens-per-second", "tokens_per_s", 1),
                           ("mem-max-allocated-bytes", "memory_mb", 2 ** 20), ("lm loss", "lm_loss", 1)):
        got = {e.step: e.value for e in events.Scalars(tag)}
        assert sorted(got) == sorted(one_process), (tag, sorted(got))
        for it, record in one_process.items():
            assert got[it] == pytest.approx(record[key] * unit, rel=1e-6), (tag, it, got[it], record[key])


@pytest.mark.parametrize("world,extra", [
    (2, ["--expert-model-parallel-size", "2"]),
    (4, ["--expert-model-parallel-size", "2", "--tp", "2", "--sequence-parallel"]),
    (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    (4, ["--expert-model-parallel-size", "2", "--zero-stage", "3"]),  # experts over expert-DP 2 inside DP 4
    # ep 4: one expert per rank, ZeRO-2. The micro-batches hold the samples one process's do (the
    # load-balancing loss is over a micro-batch's tokens, as Megatron's aux_loss: it changes with them).
    (4, ["--expert-model-parallel-size", "4", "--zero-stage", "2"]),
    (2, ["--expert-model-parallel-size", "2", "--moe-grouped-gemm"]),  # grouped matmuls: the loop's bits
    # interleaved 1F1B (2 chunks per rank, 4 micro-batches) with ep 2
    (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
         "--virtual-pipeline-model-parallel-size", "2"]),
    # context parallelism: cp 2 x ep 2 (the experts over the data x context ranks), ring attention
    (4, ["--expert-model-parallel-size", "2", "--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    # full recomputation and the optimizer state offloaded to the host, at ep 2 with ZeRO-2
    (2, ["--expert-model-parallel-size", "2", "--recompute-granularity", "full", "--recompute-method", "uniform",
         "--zero-stage", "2", "--optimizer-cpu-offload"]),
    # expert tensor parallelism other than TP: whole experts under tp 2 (each rank routes its own tokens) ...
    (2, ["--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2"]),
    (4, ["--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "2",
         "--pipeline-model-parallel-size", "2"]),
    (4, ["--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size", "4",
         "--zero-stage", "3", "--moe-grouped-gemm"]),  # ZeRO-3 gathers the grouped matmuls' experts again in backward
    (2, ["--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--zero-stage", "2"]),  # ep 1
    # ... and experts sharded over 2 data-parallel ranks at tp 1, over expert-DP 2 with ZeRO-3
    (4, ["--expert-tensor-parallel-size", "2", "--expert-model-parallel-size", "2", "--zero-stage", "3",
         "--moe-grouped-gemm"]),
])
def test_mixture_of_experts_equals_one_process(data, one_process, tmp_path, world, extra):  # noqa: F811
    got = launch(world, flags(data, *MOE, *extra), tmp_path, "moe")
    assert_same_run(got, one_process, what=f"MoE world {world} {extra}")
    # the log line's router loss and expert load (in the metrics file and TensorBoard too)
    for it, ref in one_process.items():
        for key in ("moe_aux_loss", "expert_load_max_over_mean"):
            assert got[it][key] == pytest.approx(ref[key], rel=1e-5), (it, key, got[it][key], ref[key])
    assert all(r["moe_aux_loss"] > 0 and r["expert_load_max_over_mean"] >= 1 for r in one_process.values())


CAPACITY = ("--moe-expert-capacity-factor", "1.0", "--moe-token-drop-policy", "probs")


@pytest.fixture(scope="module")
def one_process_capacity(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, *MOE, *CAPACITY), tmp_path_factory.mktemp("moe1_capacity"), "moe1_capacity")


@pytest.mark.parametrize("world,extra", [
    (2, ["--expert-model-parallel-size", "2"]),
    (4, ["--expert-model-parallel-size", "2", "--tp", "2", "--sequence-parallel"]),
    (4, ["--expert-model-parallel-size", "2", "--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1"]),
    # context parallelism: each rank holds two chunks of every sequence; the drops are decided over the
    # whole sequences, in one process's token order
    (4, ["--expert-model-parallel-size", "2", "--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    (4, ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--tp", "2", "--sequence-parallel"]),
    (4, ["--context-parallel-size", "2", "--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    # padded to capacity (fixed all-to-all sizes): the same dropped copies, zero rows besides
    (2, ["--expert-model-parallel-size", "2", "--moe-pad-expert-input-to-capacity"]),
    (4, ["--expert-model-parallel-size", "2", "--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1",
         "--moe-pad-expert-input-to-capacity"]),
    (4, ["--expert-model-parallel-size", "2", "--context-parallel-size", "2", "--moe-pad-expert-input-to-capacity",
         "--moe-grouped-gemm"]),
])
def test_token_dropping_drops_the_same_copies_at_every_layout(data, one_process, one_process_capacity, tmp_path,  # noqa: F811
                                                              world, extra):
    # Capacity is decided over the micro-batch a rank routes (gathered over TP, also where each TP rank
    # sends its own tokens): the dropped copies, and so the losses, are those of one process.
    got = launch(world, flags(data, *MOE, *CAPACITY, *extra), tmp_path, "moe_capacity")
    assert_same_run(got, one_process_capacity, what=f"MoE capacity 1.0, world {world} {extra}")
    for it, ref in one_process_capacity.items():
        assert got[it]["moe_dropped_fraction"] == pytest.approx(ref["moe_dropped_fraction"], rel=1e-6)
    assert any(r["moe_dropped_fraction"] > 0 for r in one_process_capacity.values()), "nothing was dropped"
    assert any(abs(one_process_capacity[it]["lm_loss"] - one_process[it]["lm_loss"]) > 1e-6 for it in one_process)


def test_dropping_the_latest_copies_under_context_parallelism_equals_one_process(data, tmp_path):  # noqa: F811
    # 'position' keeps each expert's earliest copies: under cp 2 a rank holds chunks from both ends of
    # each sequence, so "earliest" must be read in one process's token order.
    position = [a if a != "probs" else "position" for a in CAPACITY]
    one = launch(1, flags(data, *MOE, *position), tmp_path, "position1")
    got = launch(4, flags(data, *MOE, *position, "--context-parallel-size", "2", "--expert-model-parallel-size", "2"),
                 tmp_path, "position_cp2")
    assert_same_run(got, one, what="capacity by position, cp 2 x ep 2")
    assert all(got[it]["moe_dropped_fraction"] == pytest.approx(one[it]["moe_dropped_fraction"]) for it in one)
    # packed documents balanced per sample: each sample's tokens sit at positions of their own
    documents = [*MOE, *position, "--position-embedding-type", "rope", "--reset-position-ids",
                 "--reset-attention-mask", "--eod-mask-loss"]
    one = launch(1, flags(data, *documents), tmp_path, "position1_documents")
    got = launch(2, flags(data, *documents, "--context-parallel-size", "2", "--cp-comm-type", "p2p"), tmp_path,
                 "position_cp2_documents")
    assert_same_run(got, one, what="capacity by position, cp 2, documents balanced per sample")


def test_a_layer_pattern_with_dense_layers_first_equals_one_process(data, tmp_path):  # noqa: F811
    # Megatron's --moe-layer-freq pattern (DeepSeek-V3 puts its dense layers first): layer 0 dense, 1-3
    # mixtures; at pp 2 x ep 2 the first stage holds one mixture, the second two.
    pattern = [*MOE[:-2], "--moe-layer-freq", "([0]*1+[1]*3)"]
    one = launch(1, flags(data, *pattern), tmp_path, "pattern1")
    got = launch(4, flags(data, *pattern, "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"),
                 tmp_path, "pattern4")
    assert_same_run(got, one, what="--moe-layer-freq ([0]*1+[1]*3), pp 2 x ep 2")
    log = open(tmp_path / "pattern4.log").read()
    assert "3 of 4 layers mixtures of 4 experts, top-2" in log
    assert log.count("pipeline: ") == 1, log  # the stages' split, said once


QWEN2 = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--disable-bias-linear",
         "--add-qkv-bias", "--swiglu", "--moe-router-pre-softmax", "--moe-shared-expert-intermediate-size", "40",
         "--moe-shared-expert-gate", "--moe-aux-loss-coeff", "0.001")


def test_shared_experts_and_qkv_bias_equal_one_process(data, tmp_path):  # noqa: F811
    # Qwen2-MoE's layer: a gated shared expert beside the routed ones, a bias on QKV only. At tp 2 the
    # shared expert's output and its gate's gradient are partial per rank and summed with the experts'.
    one = launch(1, flags(data, *QWEN2), tmp_path, "qwen2_moe1")
    for world, extra in ((2, ["--expert-model-parallel-size", "2"]),
                         (4, ["--expert-model-parallel-size", "2", "--tp", "2", "--sequence-parallel"])):
        got = launch(world, flags(data, *QWEN2, *extra), tmp_path, f"qwen2_moe_{world}")
        assert_same_run(got, one, what=f"shared experts, world {world} {extra}")


GQA_MOE = ("--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--group-query-attention",
           "--num-query-groups", "2", "--ffn-hidden-size", "96", "--swiglu", "--normalization", "RMSNorm",
           "--position-embedding-type", "rope", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
           "--num-experts", "4", "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01")


def test_tensor_parallel_experts_without_sequence_parallelism_equal_one_process(data, tmp_path):  # noqa: F811
    # Without SP every TP rank routes all the tokens; the experts' outputs are partial over TP, and so
    # are the gradients of the weights combining them (the router's gradient is summed over TP).
    one = launch(1, flags(data, *GQA_MOE, layers=2), tmp_path, "gqa_moe1")
    for world, extra in ((2, ["--tp", "2"]), (4, ["--tp", "2", "--pipeline-model-parallel-size", "2"])):
        got = launch(world, flags(data, *GQA_MOE, *extra, layers=2), tmp_path, f"gqa_moe_{world}")
        assert_same_run(got, one, rtol=1e-5, what=f"MoE without SP, world {world} {extra}")
        for it, ref in one.items():
            assert got[it]["moe_aux_loss"] == pytest.approx(ref["moe_aux_loss"], rel=1e-5), it


DEEPSEEK = ("--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24", "--disable-bias-linear",
            "--swiglu", "--moe-router-score-function", "sigmoid", "--moe-router-num-groups", "2",
            "--moe-router-group-topk", "1", "--moe-router-topk-scaling-factor", "2.5", "--moe-router-dtype", "fp64",
            "--moe-aux-loss-coeff", "0.01", "--moe-shared-expert-intermediate-size", "24")


def test_deepseek_routing_equals_one_process(data, tmp_path):  # noqa: F811
    # Sigmoid scores, group-limited to the best of 2 groups, scaled weights, an fp64 router and a
    # shared expert: ep 2 inside dp 2 against one process.
    one = launch(1, flags(data, *DEEPSEEK), tmp_path, "deepseek1")
    got = launch(2, flags(data, *DEEPSEEK, "--expert-model-parallel-size", "2"), tmp_path, "deepseek2")
    assert_same_run(got, one, what="DeepSeek-style routing at ep 2")


def test_expert_bias_is_the_same_at_every_layout_and_resumes(data, tmp_path):  # noqa: F811
    # Auxiliary-loss-free balancing: the biases move with the global batch's loads (summed over the
    # data-parallel ranks once per step), so ep 2 inside dp 2 trains as one process; they are
    # checkpointed, so a run saved at ep 2 and resumed in one process continues as if uninterrupted.
    bias = [a for a in DEEPSEEK if a not in ("--moe-router-dtype", "fp64")] + [
        "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "0.05"]
    one = launch(1, flags(data, *bias), tmp_path, "bias1")
    got = launch(2, flags(data, *bias, "--expert-model-parallel-size", "2"), tmp_path, "bias2")
    assert_same_run(got, one, what="expert bias at ep 2")
    assert_resumes_elsewhere(data, bias, (2, ["--expert-model-parallel-size", "2"]), [(1, [])], one, tmp_path,
                             "bias")


def test_sequence_aux_loss_is_the_same_for_any_split_of_the_global_batch(data, tmp_path):  # noqa: F811
    # seq_aux_loss averages a per-sequence loss over the sequences: micro-batches of 1 or 2, on one
    # rank or on dp 2 with ep 2 and tp 2 (SP), train the same model. (Switch's aux_loss would not:
    # it is over a micro-batch's tokens.)
    seq = [a if a != "0.01" else "0.05" for a in MOE] + ["--moe-router-load-balancing-type", "seq_aux_loss"]
    one = launch(1, flags(data, *seq), tmp_path, "seqaux_mb2")
    for world, extra in ((1, ["--micro-batch-size", "1"]),
                         (4, ["--micro-batch-size", "1", "--expert-model-parallel-size", "2", "--tp", "2",
                              "--sequence-parallel"])):
        got = launch(world, flags(data, *seq, *extra), tmp_path, f"seqaux_{world}")
        assert_same_run(got, one, what=f"seq_aux_loss, world {world} {extra}")
        for it, ref in one.items():
            assert got[it]["moe_aux_loss"] == pytest.approx(ref["moe_aux_loss"], rel=1e-5)


@pytest.mark.parametrize("argv,message", [
    (["--num-experts", "6", "--expert-model-parallel-size", "4"], "not divisible by --expert-model-parallel-size 4"),
    (["--num-experts", "8", "--expert-model-parallel-size", "8"], "must divide the ranks of a pipeline stage"),
    (["--num-experts", "4", "--expert-model-parallel-size", "4", "--tp", "2", "--sequence-parallel"],
     "2 x 2 x 1 = 4"),  # ep 4 x etp (= tp) 2 = 8 over a stage of 4 ranks
    (["--num-experts", "4", "--expert-tensor-parallel-size", "8"], "--expert-tensor-parallel-size 8 = 8 must"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "4", "--moe-ffn-hidden-size", "6"],
     "not divisible by --expert-tensor-parallel-size 4"),
    (["--expert-model-parallel-size", "2"], "needs --num-experts"),
    (["--num-experts", "4", "--moe-router-topk", "5"], "--moe-router-topk in 1..num_experts"),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "1", "--tp", "2"], "needs --sequence-parallel"),
    (["--num-experts", "4", "--moe-expert-capacity-factor", "0"], "must be > 0"),
    (["--num-experts", "4", "--moe-router-load-balancing-type", "sinkhorn"], "not available"),
    (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], "needs --moe-expert-capacity-factor"),
    (["--num-experts", "4", "8"], "one number of experts"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,0,1]"], "for each of the 2 layers"),
    (["--num-experts", "4", "--moe-layer-freq", "[1,2]"], "for each of the 2 layers"),
    (["--num-experts", "4", "--moe-layer-freq", "range(2)"], "give an int or a list of 0/1"),
])
def test_impossible_moe_settings_are_refused_with_the_numbers(argv, message):
    base = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--lr", "1e-3", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64", "--disable-bias-linear"]
    with pytest.raises((ConfigError, SystemExit)) as e:
        parse_args(base + argv, world_size=4, check_files=False)
    assert message in str(e.value) or isinstance(e.value, SystemExit), str(e.value)


def test_a_checkpoint_saved_at_ep2_resumes_at_ep1_and_ep4(data, one_process, tmp_path):  # noqa: F811
    # Saved every iteration by ep 2 with ZeRO-3 (each expert partitioned over its expert-DP ranks);
    # resumed from iteration 2 in one process and at ep 4 with ZeRO-1: iterations 3-4 equal the
    # uninterrupted one-process run (optimizer state included).
    assert_resumes_elsewhere(data, list(MOE), (4, ["--expert-model-parallel-size", "2", "--zero-stage", "3"]),
                             [(1, []), (4, ["--expert-model-parallel-size", "4", "--zero-stage", "1"])], one_process,
                             tmp_path, "ep2")
    # saved with whole experts under tp 2 (expert tensor parallelism 1, ZeRO-3 over expert-DP 2); resumed in
    # one process, and with the experts sharded over etp = tp 2 at ep 2
    etp1 = ["--tp", "2", "--sequence-parallel", "--expert-tensor-parallel-size", "1", "--expert-model-parallel-size",
            "2", "--zero-stage", "3"]
    assert_resumes_elsewhere(data, list(MOE), (4, etp1), [(1, []), (4, ["--tp", "2", "--sequence-parallel",
                                                                          "--expert-model-parallel-size", "2"])],
                             one_process, tmp_path, "etp1")
    # saved in one process (every expert on the rank), resumed with whole experts spread over tp 2 x ep 2
    assert_resumes_elsewhere(data, list(MOE), (1, []), [(4, etp1[:-2])], one_process, tmp_path, "ep1")
    # tools/generate.py's loader reads the experts of that checkpoint at tp 1 and 2: the losses of
    # the whole model read back by megazero
    import torch

    from megazero.model import GPTModel
    from megazero.mpu import NO_GROUP
    from megazero.checkpoint.native import load_full_model
    from tests.distributed import run_distributed
    from tests.training.test_tools_scale import _generate_losses

    src = str(tmp_path / "ep2_ckpt")
    cfg, weights, _ = load_full_model(src)
    model = GPTModel(cfg, tp_group=NO_GROUP)
    model.load_state_dict(weights, strict=True)
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model.eval()(ids[:, :-1], labels=ids[:, 1:])
    for tp in (1, 2):
        for loss, _, _ in run_distributed(tp, _generate_losses, src, tp):
            torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)
    # the etp 1 checkpoint (whole experts in the files of both TP ranks) reads back whole, and at tp 2
    src = str(tmp_path / "etp1_ckpt")
    cfg, weights, _ = load_full_model(src)
    model = GPTModel(cfg, tp_group=NO_GROUP)
    model.load_state_dict(weights, strict=True)
    with torch.no_grad():
        ref = model.eval()(ids[:, :-1], labels=ids[:, 1:])
    for loss, _, _ in run_distributed(2, _generate_losses, src, 2):
        torch.testing.assert_close(loss, ref, atol=1e-5, rtol=1e-5)


def test_a_mixtral_trained_at_ep2_exports_to_transformers(data, tmp_path):  # noqa: F811
    # Mixtral's shape (RoPE, RMSNorm, SwiGLU, GQA, every layer a mixture), trained 2 iterations at
    # ep 2 with ZeRO-3 and saved; tools/convert_to_hf.py writes the per-expert HF names, transformers
    # loads them, and its logits are those of the checkpoint's weights read back by megazero.
    import importlib.util

    import torch

    transformers = pytest.importorskip("transformers")
    from megazero.model import GPTModel
    from megazero.model.state_dict import load_full_state_dict
    from megazero.checkpoint.reader import open_checkpoint

    mixtral = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear", "--swiglu",
               "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--num-query-groups", "2",
               "--untie-embeddings-and-output-weights", "--moe-aux-loss-coeff", "0.02"]
    saved = str(tmp_path / "ckpt")
    launch(4, flags(data, *mixtral, "--expert-model-parallel-size", "2", "--zero-stage", "3", "--save", saved,
                    "--train-iters", "2"), tmp_path, "mixtral_ep2")
    from pathlib import Path

    tool_path = Path(__file__).resolve().parents[2] / "tools" / "convert_to_hf.py"
    spec = importlib.util.spec_from_file_location("convert_to_hf", tool_path)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    assert tool.main(["--input", saved, "--output", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == "MixtralForCausalLM"
    config, reader, _ = open_checkpoint(saved)
    model = GPTModel(config.replace(recompute_granularity=None)).eval()
    load_full_state_dict(model, {n: reader.full(n) for n in reader.names})
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids)[..., :config.vocab_size], hf(ids).logits, atol=1e-4, rtol=1e-4)


# Megatron-DeepSpeed's MoE spelling (examples_deepspeed/MoE/ds_pretrain_gpt_*_MoE*.sh), its defaults left out
DS_MOE = ("--num-experts", "4", "--moe-loss-coeff", "0.01", "--moe-train-capacity-factor", "1.0",
          "--moe-eval-capacity-factor", "2.0", "--moe-min-capacity", "4", "--create-moe-param-group")


def test_deepspeed_moe_flags_are_read_with_deepspeeds_defaults():
    base = ["--num-layers", "4", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--max-position-embeddings", "16", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--lr", "1e-3", "--train-iters", "1", "--mock-data", "--tokenizer-type", "NullTokenizer",
            "--vocab-size", "64"]
    cfg = parse_args(base + list(DS_MOE) + ["--moe-expert-parallel-size", "2"], world_size=4, check_files=False)
    notes = cfg.notes
    m = cfg.model
    assert m.moe_layer_freq == (0, 1, 0, 1) and [m.is_moe_layer(i) for i in range(4)] == [False, True, False, True]
    assert (m.moe_router_topk, m.moe_router_pre_softmax, m.moe_aux_loss_coeff) == (1, True, 0.01)
    assert (m.moe_expert_capacity_factor, m.moe_eval_capacity_factor, m.moe_min_capacity) == (1.0, 2.0, 4)
    assert cfg.parallel.ep == 2 and any("DeepSpeed-MoE flags" in n for n in notes)
    dropless = parse_args(base + ["--num-experts", "4", "--disable-moe-token-dropping", "--topk", "2",
                                  "--expert-interval", "1"], world_size=1, check_files=False)
    d = dropless.model
    assert (d.moe_expert_capacity_factor, d.moe_router_topk, d.moe_router_pre_softmax, d.moe_layer_freq) == (
        None, 2, False, (1, 1, 1, 1))
    assert d.moe_aux_loss_coeff == 0.1  # DeepSpeed's default loss coefficient
    dense = parse_args(base + ["--num-experts", "1", "--moe-loss-coeff", "0.01"], world_size=1, check_files=False)
    assert dense.model.num_experts is None
    with pytest.raises(ConfigError, match="disagree"):
        parse_args(base + ["--num-experts", "4", "--topk", "1", "--moe-router-topk", "2"], 1, check_files=False)


def test_a_deepspeed_moe_launch_equals_one_process(data, tmp_path):  # noqa: F811
    # Top-1 over the softmax of all experts, every second layer, capacity 1.0 with at least 4 copies, the
    # loss at 0.01, experts with biases (Megatron-DeepSpeed's GPT): at ep 2, ep 2 x pp 2, tp 2 (the output
    # bias added once over the TP shards) and tp 2 with whole experts as in one process.
    one = launch(1, flags(data, *DS_MOE), tmp_path, "ds_moe1")
    assert any(r["moe_dropped_fraction"] > 0 for r in one.values()), "nothing was dropped"
    for world, extra in ((2, ["--moe-expert-parallel-size", "2"]),
                         (4, ["--moe-expert-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
                         (4, ["--moe-expert-parallel-size", "2", "--tp", "2", "--sequence-parallel"]),
                         (4, ["--moe-expert-parallel-size", "2", "--tp", "2", "--sequence-parallel",
                              "--expert-tensor-parallel-size", "1", "--zero-stage", "3"])):
        got = launch(world, flags(data, *DS_MOE, *extra), tmp_path, f"ds_moe{world}")
        assert_same_run(got, one, what=f"DeepSpeed-MoE flags, world {world} {extra}")


def test_megatron_deepspeeds_moe_script_parses_as_it_trains(tmp_path):
    # The flags of Megatron-DeepSpeed's examples_deepspeed/MoE/ds_pretrain_gpt_125M_MoE64.sh on 64 GPUs (its
    # DeepSpeed JSON as the script's template fills it): 64 experts in every second layer, top-1, ep 64.
    import json

    ds = tmp_path / "ds_config_gpt.json"
    ds.write_text(json.dumps({"train_batch_size": 256, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
                              "zero_optimization": {"stage": 0}, "gradient_clipping": 1.0, "prescale_gradients": True,
                              "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                                       "min_loss_scale": 1, "initial_scale_power": 11}, "bf16": {"enabled": False},
                              "wall_clock_breakdown": False}))
    argv = f"""--vocab-file v.json --merge-file m.txt --data-path d --data-impl mmap --override-opt_param-scheduler
     --adam-beta1 0.9 --adam-beta2 0.95 --tensor-model-parallel-size 1 --moe-expert-parallel-size 64 --num-experts 64
     --moe-loss-coeff 0.01 --moe-train-capacity-factor 1.0 --moe-eval-capacity-factor 1.0 --moe-min-capacity 4
     --init-method-std 0.014 --lr-decay-tokens 300000000000 --lr-warmup-tokens 375000000 --micro-batch-size 4
     --exit-duration-in-mins 30000000 --global-batch-size 256 --num-layers 12 --hidden-size 768
     --num-attention-heads 12 --seq-length 2048 --max-position-embeddings 2048 --train-tokens 300000000000
     --train-iters 1716613 --lr 4.5e-4 --min-lr 4.5e-06 --lr-decay-style cosine --split 98,2,0 --log-interval 10
     --eval-interval 100 --eval-iters 10 --save-interval 10000 --weight-decay 0.1 --clip-grad 1.0 --hysteresis 2
     --num-workers 0 --fp16 --load ck --save ck --tensorboard-queue-size 1 --log-timers-to-tensorboard
     --log-batch-size-to-tensorboard --log-validation-ppl-to-tensorboard --tensorboard-dir tb
     --create-moe-param-group --deepspeed --deepspeed_config {ds} --pipeline-model-parallel-size 1
     --no-pipeline-parallel""".split()
    cfg = parse_args(argv, world_size=64, check_files=False)
    m = cfg.model
    assert (m.num_experts, m.moe_router_topk, m.moe_router_pre_softmax, m.add_bias_linear) == (64, 1, True, True)
    assert [i for i in range(12) if m.is_moe_layer(i)] == [1, 3, 5, 7, 9, 11]
    assert (m.moe_expert_capacity_factor, m.moe_min_capacity, m.moe_aux_loss_coeff) == (1.0, 4, 0.01)
    assert (cfg.parallel.ep, cfg.parallel.dp, cfg.precision.dtype) == (64, 64, "fp16")
    assert any("experts in layers 1, 3, 5, 7, 9, 11 (--expert-interval 2), top-1" in n for n in cfg.notes)


def test_megatron_lms_mixtral_script_parses_as_it_trains():
    # The flags of Megatron-LM's examples/mixtral/train_mixtral_8x7b_distributed.sh on 8 nodes (its tokenizer's
    # vocabulary given as --vocab-size): --sequence-parallel at tp 1 is turned off as Megatron-LM does, and
    # --no-position-embedding beside rope means no learned table.
    argv = """--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768
    --num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01
    --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
    --untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
    --no-position-embedding --rotary-base 1000000 --num-experts 8 --moe-router-topk 2
    --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce --tokenizer-type Llama2Tokenizer
    --tokenizer-model tokenizer.model --data-path data --split 99990,8,2 --micro-batch-size 1 --global-batch-size 256
    --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000 --lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1
    --lr-warmup-iters 500 --clip-grad 1.0 --bf16 --tensor-model-parallel-size 1 --pipeline-model-parallel-size 4
    --expert-model-parallel-size 8 --use-distributed-optimizer --sequence-parallel --log-interval 1
    --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save ck --load ck --tensorboard-dir tb
    --no-load-optim --no-load-rng --vocab-size 32000""".split()
    cfg = parse_args(argv, world_size=64, check_files=False)
    m, p = cfg.model, cfg.parallel
    assert (m.num_experts, m.moe_router_topk, m.position_embedding_type, m.moe_grouped_gemm) == (8, 2, "rope", True)
    assert (p.tp, p.pp, p.ep, p.dp, p.zero_stage, p.sequence_parallel) == (1, 4, 8, 16, 1, False)
    assert any("--sequence-parallel with --tp 1: off" in n for n in cfg.notes)
