"""The argument lists of real Megatron-LM / Megatron-DeepSpeed launch scripts (tests/scripts/*.args,
origins in their headers) parse as their authors meant, before any process group exists."""

import json
import os
import shlex

import pytest

from megazero.config import ConfigError, parse_args

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = ("train_gpt3_175b_distributed", "pretrain_gpt_distributed_with_mp", "run_deepspeed_example",
           "run-175b", "pretrain_llama2_distributed", "ds_pretrain_gpt_1.3B")


def script_args(name: str, **paths: str) -> list[str]:
    """The script's arguments with {PLACEHOLDER}s filled (DS_CONFIG defaults to the script's JSON)."""
    paths.setdefault("DS_CONFIG", os.path.join(HERE, f"{name}.json"))
    for key in ("DATA", "VOCAB", "MERGE", "CKPT", "TB", "TOKENIZER_MODEL"):
        paths.setdefault(key, f"/nonexistent/{key.lower()}")
    text = "\n".join(line for line in open(os.path.join(HERE, f"{name}.args")) if not line.startswith("#"))
    for key, value in paths.items():
        text = text.replace("{" + key + "}", value)
    return shlex.split(text)


def parse(name, world=4, **kw):
    return parse_args(script_args(name), world, check_files=False, **kw)


def test_every_list_has_its_origin():
    for name in SCRIPTS:
        header = open(os.path.join(HERE, f"{name}.args")).readline()
        assert header.startswith("# ") and ("Megatron-LM" in header or "Megatron-DeepSpeed" in header), name


def test_train_gpt3_175b():
    cfg = parse("train_gpt3_175b_distributed")
    s = cfg.schedule
    assert (cfg.parallel.tp, cfg.parallel.dp, cfg.precision.dtype) == (2, 2, "fp16")
    assert s.rampup_batch_size == (2, 2, 12) and s.global_batch_size == 8
    # ramp 2 -> 8 by 2 every 12 / 3 = 4 samples: iterations of 2, 2, 4 (consumed 0, 2, 4)
    assert s.train_samples == 2 + 2 + 4
    assert cfg.precision.initial_loss_scale == 2.0 ** 32  # Megatron's default
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer"  # pretrain_gpt.py's default, no --tokenizer-type
    assert cfg.model.attention_backend == "auto"


def test_pretrain_gpt_distributed_with_mp():
    cfg = parse("pretrain_gpt_distributed_with_mp")
    assert cfg.model.recompute_granularity == "full" and cfg.parallel.distributed_backend == "gloo"
    assert cfg.schedule.lr_warmup_samples == int(0.01 * 3 * 16)
    # torch.distributed.launch also passes --local_rank
    assert parse_args(["--local_rank=1"] + script_args("pretrain_gpt_distributed_with_mp"), 4,
                      check_files=False).parallel.local_rank == 1


def test_run_deepspeed_example_json_governs_the_loss_scaler():
    cfg = parse("run_deepspeed_example")
    p = cfg.precision
    # --loss-scale 12 beside "initial_scale_power": 12: dynamic, starting at 4096 (Megatron-DeepSpeed)
    assert p.dtype == "fp16" and p.loss_scale is None and p.initial_loss_scale == 4096
    assert any("--loss-scale 12 is superseded" in n for n in cfg.notes)
    assert cfg.parallel.zero_stage == 2 and cfg.logging.wall_clock_breakdown and cfg.logging.log_interval == 1
    assert any("--save-interval 1000 without --save" in n for n in cfg.notes)
    assert cfg.checkpoint.save_interval is None
    fp16 = cfg.zero_config().fp16
    assert fp16.loss_scale == 0 and fp16.initial_scale_power == 12


def test_run_175b_ignored_keys_are_named_once():
    cfg = parse("run-175b")
    assert cfg.parallel.zero_stage == 3 and cfg.precision.initial_loss_scale == 2.0 ** 15
    ignored = [n for n in cfg.notes if n.startswith("DeepSpeed JSON keys ignored")]
    assert len(ignored) == 1
    for key in ("zero_optimization.sub_group_size", "zero_optimization.stage3_max_reuse_distance", "aio",
                "zero_allow_untested_optimizer"):
        assert key in ignored[0]
    honoured = ("reduce_bucket_size", "stage3_prefetch_bucket_size", "stage3_max_live_parameters",
                "stage3_param_persistence_threshold", "overlap_comm")
    assert not any(f"zero_optimization.{key}" in ignored[0] for key in honoured)
    z = cfg.zero_config().zero_optimization
    assert z.offload_optimizer.device == "none"
    # The engine's knobs reach it as the JSON wrote them.
    assert {k: getattr(z, k) for k in honoured} == {
        "reduce_bucket_size": 90000000, "stage3_prefetch_bucket_size": 5e7, "stage3_max_live_parameters": 3e9,
        "stage3_param_persistence_threshold": 1e5, "overlap_comm": True}


def test_pretrain_llama2_distributed():
    # Without the tokenizer file (check_files=False) its vocabulary size must be given to plan the model.
    args = script_args("pretrain_llama2_distributed") + ["--vocab-size", "512"]
    cfg = parse_args(args, 4, check_files=False)
    m = cfg.model
    assert (m.position_embedding_type, m.normalization, m.activation, m.add_bias_linear, m.tie_embeddings) == \
        ("rope", "rmsnorm", "swiglu", False, False)
    assert m.num_query_groups == 2 and m.ffn_size == 128 and m.hidden_dropout == 0
    assert cfg.data.tokenizer_type == "GPTSentencePieceTokenizer" and cfg.precision.dtype == "bf16"
    assert cfg.parallel.zero_stage == 0 and cfg.optim.type == "AdamW"


def test_ds_pretrain_gpt_1_3b_token_schedule():
    cfg = parse("ds_pretrain_gpt_1.3B")
    s = cfg.schedule
    assert s.lr_unit == "tokens" and (s.lr_warmup_samples, s.lr_decay_samples) == (64, 768)
    assert s.train_tokens == 768 and s.train_samples == 48 and s.train_iters == 6
    assert s.override_opt_param_scheduler and s.exit_duration_in_mins == 30000000
    assert cfg.logging.log_timers_to_tensorboard and cfg.logging.tensorboard_queue_size == 1
    assert cfg.precision.initial_loss_scale == 2.0 ** 11 and cfg.precision.loss_scale_window == 500


@pytest.mark.parametrize("name, pp, world", [("pretrain_gpt_distributed_with_mp", 2, 8),
                                             ("pretrain_llama2_distributed", 2, 8)])
def test_original_pipeline_sizes_run(name, pp, world):
    args = script_args(name) + ["--vocab-size", "512"]
    args[args.index("--pipeline-model-parallel-size") + 1] = str(pp)
    if "--tensor-model-parallel-size" in args:
        args[args.index("--tensor-model-parallel-size") + 1] = "2"
    try:
        cfg = parse_args(args, world, check_files=False)
    except ConfigError as e:  # the sentencepiece tokenizer lives on another branch
        assert "GPTSentencePieceTokenizer" in str(e)
        return
    assert (cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.dp) == (pp, 2, world // (2 * pp))


def test_original_175b_pipeline_layout_refused_with_the_numbers():
    args = script_args("train_gpt3_175b_distributed")
    args[args.index("--pipeline-model-parallel-size") + 1] = "16"
    with pytest.raises(ConfigError, match=r"--num-layers \(2\) is not divisible by the pipeline size \(16\)"):
        parse_args(args, 64, check_files=False)


@pytest.mark.parametrize("extra, message", [
    ("--num-experts 8 --mlp-type residual", "--mlp-type residual (DeepSpeed's PR-MoE"),
    ("--num-experts 8 --moe-token-dropping", "--moe-token-dropping: DeepSpeed-MoE's switch"),
    ("--fp8-format hybrid", "--fp8-format: FP8 and FP4 training do not exist in megazero yet; use --bf16"),
    ("--transformer-impl transformer_engine", "Transformer Engine does not exist in megazero"),
    ("--no-save-optim", "--no-save-optim: megazero checkpoints always hold the optimizer"),
    ("--partition-activations", "use --sequence-parallel"),
    ("--data-impl lazy", "--data-impl lazy does not exist in megazero"),
])
def test_refused_flags_name_the_way(extra, message):
    with pytest.raises(ConfigError, match="refused before any process starts") as e:
        parse_args(script_args("pretrain_gpt_distributed_with_mp") + extra.split(), 4, check_files=False)
    assert message in str(e.value)


def test_run_175b_with_its_offload_device_cpu(tmp_path):
    """run-175b.sh with OFFLOAD_DEVICE=cpu: its JSON's offload_optimizer says cpu and CPU_OPTIM adds
    --cpu-optimizer; both reach the engine (optimizer state on the host), pinned as the JSON asks."""
    ds = json.load(open(os.path.join(HERE, "run-175b.json")))
    ds["zero_optimization"]["offload_optimizer"]["device"] = "cpu"
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(ds))
    cfg = parse_args(script_args("run-175b", DS_CONFIG=str(path)) + ["--cpu-optimizer"], 4, check_files=False)
    off = cfg.zero_config().zero_optimization.offload_optimizer
    assert off.device == "cpu" and off.pin_memory is True and off.buffer_count == 4 and off.enabled


def test_modern_megatron_flags_map():
    base = script_args("pretrain_gpt_distributed_with_mp")
    extra = ("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --attention-backend unfused "
             "--transformer-impl local --use-mcore-models --no-masked-softmax-fusion --no-bias-gelu-fusion "
             "--no-bias-dropout-fusion --no-gradient-accumulation-fusion --accumulate-allreduce-grads-in-fp32 "
             "--attention-softmax-in-fp32 --num-workers 0 --local-rank 0").split()
    cfg = parse_args(base + extra, 4, check_files=False)
    assert cfg.parallel.zero_stage == 1 and cfg.model.attention_backend == "math"
    assert cfg.zero_config().grad_accum_dtype == "fp32"
    with pytest.raises(ConfigError, match="--use-distributed-optimizer .* contradicts --zero-stage 0"):
        parse_args(base + ["--use-distributed-optimizer", "--zero-stage", "0"], 4, check_files=False)


def test_local_rank_must_match_environment(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "2")
    with pytest.raises(ConfigError, match="--local_rank=1 disagrees with LOCAL_RANK=2"):
        parse_args(["--local_rank=1"] + script_args("pretrain_gpt_distributed_with_mp"), 4, check_files=False)


def test_docs_flag_table_is_generated_from_the_table():
    from megazero.config.flag_docs import flags_markdown

    path = os.path.join(HERE, "..", "..", "docs", "flags.md")
    assert open(path).read() == flags_markdown(), "regenerate: python -m megazero.config.flag_docs > docs/flags.md"
