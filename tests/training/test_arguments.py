"""Command line -> TrainConfig: resolution, DeepSpeed JSON merge, and every up-front refusal."""

import json

import pytest
import torch

from megazero.config import ConfigError, check_vocab, parse_args, parse_args_or_exit
from megazero.config.arguments import GPT2_VOCAB_SIZE
from megazero.zero.config import FP16Config, OptimizerConfig, ZeroOptimizationConfig

TINY = "--model-preset gpt-tiny --micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data".split()


def parse(extra="", base=TINY, world=4, **kw):
    return parse_args(base + extra.split(), world, **kw)


@pytest.fixture
def dataset(tmp_path):
    prefix = tmp_path / "corpus_text_document"
    for ext in (".bin", ".idx"):
        (tmp_path / f"corpus_text_document{ext}").write_bytes(b"")
    return str(prefix)


@pytest.fixture
def gpt2_files(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": 3}))
    merges.write_text("#version: 0.2\na b\n")
    return str(vocab), str(merges)


def write_json(tmp_path, obj):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(obj))
    return str(path)


def test_tree_and_derived_sizes():
    cfg = parse("--tp 2 --global-batch-size 16 --bf16 --zero-stage 2 --sequence-parallel", world=8)
    p, s = cfg.parallel, cfg.schedule
    assert (p.tp, p.pp, p.dp, p.world_size, p.zero_stage, p.sequence_parallel) == (2, 1, 4, 8, 2, True)
    # global 16 = micro 2 x dp 4 x accumulation 2
    assert (s.micro_batch_size, s.global_batch_size, s.grad_accum_steps) == (2, 16, 2)
    assert (s.train_iters, s.train_samples, s.lr_decay_samples, s.lr_warmup_samples) == (10, 160, 160, 0)
    assert cfg.model.num_layers == 2 and cfg.model.sequence_parallel and cfg.model.params_dtype == torch.bfloat16
    assert cfg.precision.dtype == "bf16" and cfg.optim.lr == 1e-3 and cfg.seed == 1234
    assert cfg.data.mock_data and cfg.model.vocab_size == 512  # from the preset, no tokenizer
    assert cfg.to_dict()["parallel"]["dp"] == 4


def test_defaults_global_batch_is_micro_times_dp():
    s = parse(world=4).schedule
    assert (s.global_batch_size, s.grad_accum_steps) == (8, 1)


def test_explicit_shape_flags_override_preset():
    m = parse("--num-layers 3 --hidden-size 128 --seq-length 32 --swiglu --disable-bias-linear "
              "--untie-embeddings-and-output-weights --position-embedding-type rope --normalization RMSNorm "
              "--num-query-groups 2 --use-flash-attn --recompute-granularity full --init-method-std 0.008",
              check_files=False).model  # planning mode: flash-attn need not run here
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (3, 128, 4, 32)
    assert (m.activation, m.add_bias_linear, m.tie_embeddings, m.position_embedding_type) == ("swiglu", False, False, "rope")
    assert (m.normalization, m.query_groups, m.attention_backend, m.recompute_granularity) == ("rmsnorm", 2, "flash", "full")
    assert m.init_method_std == 0.008


def test_without_preset_shape_is_required():
    with pytest.raises(ConfigError, match="missing required flags: --num-layers, --hidden-size \\(or a --model-preset"):
        parse_args("--micro-batch-size 1 --train-iters 1 --lr 1 --mock-data --vocab-size 8 "
                   "--num-attention-heads 2 --seq-length 8".split(), 1)


def test_samples_mode_and_warmup_fraction():
    s = parse_args(TINY[:4] + "--train-samples 1000 --lr 1e-3 --mock-data --lr-warmup-fraction 0.1 "
                              "--lr-decay-style cosine".split(), 4).schedule
    # global 8: 1000 samples -> 125 iterations; decay defaults to the train samples
    assert (s.train_iters, s.train_samples, s.lr_decay_samples, s.lr_warmup_samples) == (125, 1000, 1000, 100)
    assert s.lr_decay_style == "cosine"
    s = parse("--lr-warmup-iters 2 --lr-decay-iters 8").schedule
    assert (s.lr_warmup_samples, s.lr_decay_samples) == (16, 64)


def test_data_path_files_and_blend(dataset, tmp_path):
    other = tmp_path / "b"
    for ext in (".bin", ".idx"):
        (tmp_path / f"b{ext}").write_bytes(b"")
    base = TINY[:-1] + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    cfg = parse_args(base + ["--data-path", "0.3", dataset, "0.7", str(other)], 4)
    assert cfg.data.prefixes == [dataset, str(other)] and cfg.data.weights == pytest.approx([0.3, 0.7])
    assert cfg.model.vocab_size == 101  # NullTokenizer adds its EOD id
    assert cfg.data.split == "969,30,1"


def test_vocab_read_from_tokenizer_files(gpt2_files):
    vocab, merges = gpt2_files
    cfg = parse(f"--tokenizer-type GPT2BPETokenizer --vocab-file {vocab} --merge-file {merges}")
    assert cfg.model.vocab_size == 4  # the tokenizer decides, not the preset's 512
    cfg = parse("--tokenizer-type GPT2BPETokenizer --vocab-file nope --merge-file nope", check_files=False)
    assert cfg.model.vocab_size == GPT2_VOCAB_SIZE
    check_vocab(cfg, GPT2_VOCAB_SIZE)
    with pytest.raises(ConfigError, match=r"tokenizer has 60000 tokens but the model's embedding has only 50304"):
        check_vocab(cfg, 60000)


def test_metrics_file_defaults_under_save(tmp_path):
    cfg = parse(f"--save {tmp_path} --save-interval 5 --tensorboard-dir {tmp_path}/tb")
    assert cfg.logging.metrics_file == str(tmp_path / "metrics.jsonl")
    assert cfg.checkpoint.save_interval == 5 and cfg.logging.tensorboard_dir == f"{tmp_path}/tb"
    assert parse().logging.metrics_file is None


def test_compatibility_flags_accepted():
    cfg = parse("--deepspeed --no-pipeline-parallel --pp 1 --checkpoint-activations --generate-prompt hi "
                "--generate-tokens 5")
    assert cfg.model.recompute_granularity == "full" and cfg.generate.prompt == "hi" and cfg.generate.tokens == 5


def test_pipeline_layouts_resolve_and_plan():
    cfg = parse("--pp 2 --tp 2 --num-layers 4", world=8)
    assert (cfg.parallel.pp, cfg.parallel.tp, cfg.parallel.dp, cfg.parallel.virtual_pp) == (2, 2, 2, 1)
    cfg = parse("--pp 2 --num-layers 8 --num-layers-per-virtual-pipeline-stage 2 --global-batch-size 8", world=4)
    assert cfg.parallel.virtual_pp == 2 and cfg.schedule.grad_accum_steps == 2
    from megazero.config.arguments import describe

    text = describe(cfg)
    assert "interleaved 1F1B, 2 chunks per rank, 2 micro-batches per step, bubble (pp-1)/(v m) = 0.250" in text
    assert "stage 0: layers 0-1+4-5 (embedding); stage 1: layers 2-3+6-7 (head)" in text
    cfg = parse("--pp 2 --num-layers 6 --decoder-first-pipeline-num-layers 2", world=4)
    assert "stage 0: layers 0-1 (embedding); stage 1: layers 2-5 (head)" in describe(cfg)
    assert parse("--no-pipeline-parallel", world=4).parallel.pp == 1


def test_the_start_line_gives_each_optimizers_own_settings():
    from megazero.config.arguments import describe

    assert "; AdamW betas (0.9, 0.95) eps 1e-08, wd 0.1, clip 1.0" in describe(
        parse("--adam-beta2 0.95 --weight-decay 0.1", world=1))
    # Muon's momentum for the layers' matrices; the betas are the AdamW of everything else
    muon = describe(parse("--optimizer muon --muon-momentum 0.9 --muon-nesterov --adam-beta2 0.95", world=1))
    assert ("; Muon momentum 0.9 (Nesterov), 5 Newton-Schulz steps on the layers' matrices, AdamW betas (0.9, 0.95) "
            "eps 1e-08 on the rest, wd 0.01" in muon), muon
    assert "Muon momentum 0.95, 5 Newton-Schulz" in describe(parse("--optimizer muon", world=1))
    sgd = describe(parse("--optimizer sgd --sgd-momentum 0.8", world=1))
    assert "; SGD momentum 0.8, wd" in sgd and "betas" not in sgd


@pytest.mark.parametrize("extra, world, pattern", [
    ("--tp 3", 4, r"world size 4 is not divisible by --tp 3 x --pp 1 = 3"),
    ("--pp 3", 4, r"world size 4 is not divisible by --tp 1 x --pp 3 = 3"),
    ("--pp 2 --no-pipeline-parallel", 4, r"--no-pipeline-parallel .* contradicts --pipeline-model-parallel-size 2"),
    ("--virtual-pipeline-model-parallel-size 2", 4, r"needs a pipeline \(--pipeline-model-parallel-size > 1\)"),
    ("--pp 2 --num-layers 3", 4, r"--num-layers \(3\) is not divisible by the pipeline size \(2\)"),
    ("--pp 2 --num-layers 4 --virtual-pipeline-model-parallel-size 4", 4,
     r"stage 0 has 2 layers, not divisible by the 4 virtual pipeline stages"),
    ("--pp 2 --num-layers 4 --num-layers-per-virtual-pipeline-stage 3", 4,
     r"--num-layers \(4\) must be divisible by pp \(2\) x --num-layers-per-virtual-pipeline-stage \(3\)"),
    ("--pp 2 --num-layers 4 --virtual-pipeline-model-parallel-size 2 --global-batch-size 12", 4,
     r"groups of pp = 2, but a step has 3 micro-batches"),
    ("--pp 2 --num-layers 6 --decoder-first-pipeline-num-layers 7", 4, r"leaves -1 layers"),
    ("--global-batch-size 12", 4, r"global batch size 12 is not divisible by micro batch size 2 x data-parallel size 4 = 8"),
    ("--tp 8", 8, r"--num-attention-heads \(4\) must be divisible by the tensor parallel size \(8\)"),
    ("--tp 2 --num-query-groups 1", 2, r"--num-query-groups \(1\) must be divisible by the tensor parallel size \(2\)"),
    ("--tp 4 --ffn-hidden-size 130", 4, r"--ffn-hidden-size \(130\) must be divisible by the tensor parallel size \(4\)"),
    ("--seq-length 128", 4, r"--seq-length 128 exceeds --max-position-embeddings 64"),
    ("--bf16 --fp16", 4, r"--bf16 and --fp16 are mutually exclusive"),
    ("--train-samples 100", 4, r"exactly one of --train-iters and --train-samples \(got both\)"),
    ("--zero-stage 4", 4, r"--zero-stage must be 0, 1, 2 or 3, got 4"),
    ("--lr-warmup-iters 20", 4, r"LR warmup \(--lr-warmup-iters 20 = 160 samples\) is longer than the LR decay "
                                r"\(--lr-decay-iters 10 = 80 samples\)"),
    ("--lr-warmup-samples 5", 4, r"with --train-iters give the LR schedule in iterations"),
    ("--min-lr 1", 4, r"need 0 <= --min-lr <= --lr"),
    ("--tokenizer-type GPT2BPETokenizer", 4, r"--tokenizer-type GPT2BPETokenizer needs --vocab-file"),
    ("--tokenizer-type NullTokenizer", 4, r"NullTokenizer needs --vocab-size"),
    ("--model-preset gpt-huge", 4, r"unknown --model-preset 'gpt-huge'"),
    ("--no-such-flag", 4, r"unknown flag --no-such-flag; run with --help"),
    ("--micro-batch 2", 4, r"unknown flag --micro-batch \(did you mean --micro-batch-size\?\)"),
])
def test_refusals_name_the_numbers(extra, world, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse(extra, world=world)


def test_sequence_parallel_at_tp_1_is_turned_off_as_megatron_does():
    cfg = parse("--sequence-parallel", world=4)
    assert not cfg.parallel.sequence_parallel and not cfg.model.sequence_parallel
    assert any("--sequence-parallel with --tp 1: off" in n for n in cfg.notes)


def test_neither_train_iters_nor_samples():
    with pytest.raises(ConfigError, match=r"missing required flags: --train-iters N \(or --train-samples N\)"):
        parse_args("--model-preset gpt-tiny --micro-batch-size 1 --lr 1 --mock-data".split(), 1)


def test_missing_data_files_say_which(dataset, tmp_path):
    base = TINY[:-1] + "--tokenizer-type NullTokenizer --vocab-size 10".split()
    (tmp_path / "corpus_text_document.idx").unlink()
    with pytest.raises(ConfigError, match=r"missing .*corpus_text_document\.idx"):
        parse_args(base + ["--data-path", dataset], 1)
    with pytest.raises(ConfigError, match=r"missing required flags: --data-path PREFIX"):
        parse_args(base, 1)
    cfg = parse_args(base + ["--data-path", dataset], 1, check_files=False)  # planning elsewhere
    assert cfg.data.prefixes == [dataset]


def test_missing_tokenizer_file_names_the_flag(tmp_path):
    with pytest.raises(ConfigError, match=r"--tokenizer-model '.*spm\.model' does not exist"):
        parse(f"--tokenizer-type SentencePieceTokenizer --tokenizer-model {tmp_path}/spm.model")
    with pytest.raises(ConfigError, match=r"--merge-file '.*m\.txt' does not exist"):
        (tmp_path / "v.json").write_text("{}")
        parse(f"--tokenizer-type GPT2BPETokenizer --vocab-file {tmp_path}/v.json --merge-file {tmp_path}/m.txt")


def test_deepspeed_json_values_are_merged(tmp_path):
    path = write_json(tmp_path, {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-6, "weight_decay": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 5e7, "overlap_comm": True},
        "bf16": {"enabled": True}, "gradient_clipping": 0.5, "steps_per_print": 7})
    cfg = parse_args("--model-preset gpt-tiny --train-iters 10 --mock-data --deepspeed_config".split() + [path], 4)
    assert (cfg.schedule.global_batch_size, cfg.schedule.micro_batch_size, cfg.schedule.grad_accum_steps) == (32, 2, 4)
    o = cfg.optim
    assert (o.type, o.lr, o.adam_beta1, o.adam_beta2, o.adam_eps, o.weight_decay, o.clip_grad) == \
        ("Adam", 3e-4, 0.9, 0.95, 1e-6, 0.1, 0.5)
    assert cfg.parallel.zero_stage == 3 and cfg.precision.dtype == "bf16"
    z = cfg.zero_config()
    # The engine's knobs pass on (stage3_prefetch_bucket_size is honoured, not a DeepSpeed-internal key).
    assert z.zero_optimization == ZeroOptimizationConfig(stage=3, stage3_prefetch_bucket_size=50_000_000,
                                                         overlap_comm=True)
    assert not any(n.startswith("DeepSpeed JSON keys ignored") for n in cfg.notes)
    assert z.steps_per_print == 7 and z.gradient_accumulation_steps == 4
    o = z.optimizer
    assert (o.lr, o.betas, o.eps, o.weight_decay) == (3e-4, (0.9, 0.95), 1e-6, 0.1)
    assert z.bf16 and z.fp16 is None


def test_zero_config_without_json():
    z = parse("--fp16 --loss-scale 1024 --clip-grad 0 --zero-stage 0 --weight-decay 0.1").zero_config()
    assert z.train_batch_size == 8 and z.train_micro_batch_size_per_gpu == 2
    assert z.gradient_accumulation_steps == 1 and z.zero_optimization == ZeroOptimizationConfig(stage=0)
    assert z.fp16 == FP16Config(loss_scale=1024.0, initial_scale_power=32, loss_scale_window=1000, hysteresis=2,
                                min_loss_scale=1.0)
    assert z.gradient_clipping == 0 and z.optimizer == OptimizerConfig(
        type="AdamW", lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.1)


@pytest.mark.parametrize("json_obj, flags, pattern", [
    ({"train_micro_batch_size_per_gpu": 4}, "", r"train_micro_batch_size_per_gpu=4 .* --micro-batch-size 2"),
    ({"train_batch_size": 64}, "--global-batch-size 32", r"train_batch_size=64 .* --global-batch-size 32"),
    ({"gradient_accumulation_steps": 3}, "--global-batch-size 8", r"gradient_accumulation_steps=3 but the command line gives 1"),
    ({"zero_optimization": {"stage": 2}}, "--zero-stage 3", r"zero_optimization.stage=2 .* --zero-stage 3"),
    ({"optimizer": {"params": {"lr": 0.1}}}, "", r"optimizer.params.lr=0.1 .* --lr 0.001"),
    ({"optimizer": {"params": {"betas": [0.9, 0.95]}}}, "--adam-beta2 0.999", r"betas.1=0.95 .* --adam-beta2 0.999"),
    ({"optimizer": {"params": {"eps": 1e-6}}}, "--adam-eps 1e-8", r"eps=1e-06 .* --adam-eps 1e-08"),
    ({"optimizer": {"params": {"weight_decay": 0.1}}}, "--weight-decay 0.01", r"weight_decay=0.1 .* --weight-decay 0.01"),
    ({"gradient_clipping": 1.0}, "--clip-grad 0.5", r"gradient_clipping=1.0 .* --clip-grad 0.5"),
    ({"bf16": {"enabled": False}}, "--bf16", r"bf16.enabled=false but the command line passes --bf16"),
    ({"bf16": {"enabled": True}}, "--fp16", r"bf16.enabled=true but the command line passes --fp16"),
])
def test_deepspeed_json_conflicts(tmp_path, json_obj, flags, pattern):
    path = write_json(tmp_path, json_obj)
    with pytest.raises(ConfigError, match=pattern):
        parse(f"{flags} --deepspeed-config {path}")


def test_deepspeed_json_agreeing_values_are_fine(tmp_path):
    path = write_json(tmp_path, {"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": True},
                                 "optimizer": {"params": {"lr": 1e-3}}, "gradient_clipping": 1.0})
    assert parse(f"--bf16 --deepspeed-config {path}").precision.dtype == "bf16"
    with pytest.raises(ConfigError, match="does not exist"):
        parse(f"--deepspeed-config {tmp_path}/missing.json")


def test_cli_wrapper_prints_message_and_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args_or_exit(TINY + ["--tp", "3"], 4)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: world size 4 is not divisible") and "Traceback" not in err


def test_deepspeed_json_accumulation_derives_global_batch(tmp_path):
    path = write_json(tmp_path, {"gradient_accumulation_steps": 3})
    s = parse(f"--deepspeed-config {path}").schedule
    assert (s.global_batch_size, s.grad_accum_steps) == (24, 3)  # micro 2 x dp 4 x 3


def test_flash_attention_refused_where_it_cannot_run():
    if torch.cuda.is_available():
        pytest.skip("this check is about machines without CUDA")
    with pytest.raises(ConfigError, match="--use-flash-attn cannot run here: no CUDA device.*needs --bf16 or --fp16"):
        parse("--use-flash-attn")


# ---- Megatron / Megatron-DeepSpeed flags ---------------------------------------------------------

def test_fp16_json_block_governs_and_real_conflicts_are_refused(tmp_path):
    path = write_json(tmp_path, {"fp16": {"enabled": True, "initial_scale_power": 12}})
    cfg = parse(f"--fp16 --loss-scale 12 --deepspeed_config {path}")
    assert cfg.precision.loss_scale is None and cfg.precision.initial_loss_scale == 4096
    assert cfg.precision.loss_scale_window == 1000 and cfg.precision.hysteresis == 2  # DeepSpeed's defaults
    path = write_json(tmp_path, {"fp16": {"enabled": True, "loss_scale": 1024}})
    with pytest.raises(ConfigError, match=r"fp16.loss_scale=1024 but the command line has --loss-scale 12"):
        parse(f"--fp16 --loss-scale 12 --deepspeed_config {path}")
    path = write_json(tmp_path, {"fp16": {"enabled": True, "initial_scale_power": 12}})
    with pytest.raises(ConfigError, match=r"fp16.initial_scale_power=12 but the command line has "
                                          r"--initial-loss-scale 65536"):
        parse(f"--fp16 --initial-loss-scale 65536 --deepspeed_config {path}")
    assert parse("--fp16").precision.initial_loss_scale == 2.0 ** 32  # Megatron's default without a JSON


@pytest.mark.parametrize("block, expected", [
    ({"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_max_lr": 1e-3, "warmup_num_steps": 2,
                                     "warmup_type": "linear"}}, ("constant", 1e-4, 0.0, 16, 80)),
    ({"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2,
                                          "total_num_steps": 8, "warmup_type": "linear"}}, ("linear", 0.0, 0.0, 16, 64)),
    ({"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.1, "cos_min_ratio": 0.01, "warmup_num_steps": 2,
                                           "total_num_steps": 8, "warmup_type": "linear"}},
     ("cosine", 1e-4, 1e-5, 16, 64)),
])
def test_deepspeed_scheduler_block_maps_to_the_lr_flags(tmp_path, block, expected):
    cfg = parse(f"--deepspeed_config {write_json(tmp_path, {'scheduler': block})}")
    s = cfg.schedule
    assert (s.lr_decay_style, s.lr_warmup_init, cfg.optim.min_lr, s.lr_warmup_samples, s.lr_decay_samples) == \
        pytest.approx(expected)


@pytest.mark.parametrize("block, pattern", [
    ({"type": "OneCycle"}, r"scheduler.type 'OneCycle' is not supported; remove the scheduler block and use "
                           r"--lr-decay-style"),
    ({"type": "WarmupLR", "params": {"warmup_num_steps": 2}}, r"warmup_type 'log' .* set \"warmup_type\": \"linear\""),
])
def test_deepspeed_scheduler_refusals(tmp_path, block, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse(f"--deepspeed_config {write_json(tmp_path, {'scheduler': block})}")


@pytest.mark.parametrize("obj, pattern", [
    ({"zero_optimization": {"offload_param": {"device": "cpu"}}}, r"offload_param needs stage 3"),
    ({"zero_optimization": {"cpu_offload": True}}, r"cpu_offload: DeepSpeed's legacy key; write"),
    ({"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, r"offload_optimizer needs stage 1"),
    ({"flops_profiler": {"enabled": True}}, r"flops_profiler: DeepSpeed's flops profiler does not exist"),
    ({"activation_checkpointing": {"partition_activations": True}}, r"use --sequence-parallel"),
    ({"curriculum_learning": {"enabled": True}}, r"curriculum learning does not exist"),
    ({"trian_batch_size": 8}, r"unknown key 'trian_batch_size'"),
    ({"zero_optimization": {"stgae": 1}}, r"unknown key 'zero_optimization.stgae'"),
])
def test_deepspeed_json_refused_and_unknown_keys(tmp_path, obj, pattern):
    with pytest.raises(ConfigError, match=pattern):
        parse(f"--deepspeed_config {write_json(tmp_path, obj)}")


def test_deepspeed_json_harmless_and_comm_keys(tmp_path):
    cfg = parse(f"--deepspeed_config " + write_json(tmp_path, {
        "flops_profiler": {"enabled": False}, "zero_optimization": {"allgather_partitions": True,
                                                                    "elastic_checkpoint": False},
        "activation_checkpointing": {"partition_activations": False, "number_checkpoints": 1},
        "communication_data_type": "fp32", "prescale_gradients": True}))
    assert cfg.notes[0] == ("DeepSpeed JSON keys ignored (they tune DeepSpeed's own internals): "
                            "zero_optimization.allgather_partitions, zero_optimization.elastic_checkpoint")
    z = cfg.zero_config()
    assert z.communication_data_type == "fp32" and z.prescale_gradients


def test_rampup_with_train_samples_counts_iterations_like_megatron():
    # micro 2 x dp 4 = 8; ramp 8 -> 32 by 8 over 60 samples (one increment per 20): batches 8, 8, 8 (c=24 -> 16),
    # 16 (40 -> 24), 24 (64 > 60 -> 32), ... Megatron's update_train_iters: ramp phase while consumed <= 60.
    s = parse("--global-batch-size 32 --rampup-batch-size 8 8 60 --train-samples 200", base=[
        a for a in TINY if a not in ("--train-iters", "10")]).schedule
    # consumed: 0 ->8, 8 ->16, 16 ->24 (16/20=0 -> 8), 24 -> 40 (16), 40 -> 64 (24), then (200 - 64) // 32 = 4
    assert s.train_iters == 5 + 4 and s.rampup_batch_size == (8, 8, 60)
    with pytest.raises(ConfigError, match="START and INCR must be multiples of micro batch 2 x data-parallel size 4"):
        parse("--global-batch-size 32 --rampup-batch-size 4 4 60")
    with pytest.raises(ConfigError, match="minus START must be a positive multiple of INCR 16"):
        parse("--global-batch-size 32 --rampup-batch-size 8 16 60")


def test_token_schedule_and_wsd_flags():
    base = [a for a in TINY if a not in ("--train-iters", "10")]  # seq 64 from the preset
    s = parse("--train-samples 80 --train-tokens 4000 --lr-warmup-tokens 640 --lr-decay-tokens 5120", base=base).schedule
    assert (s.lr_unit, s.lr_warmup_samples, s.lr_decay_samples, s.train_tokens) == ("tokens", 640, 5120, 4000)
    s = parse("--train-samples 80 --lr-decay-tokens 5120 --lr-warmup-samples 8", base=base).schedule
    assert (s.lr_warmup_samples, s.lr_decay_samples) == (8 * 64, 5120)  # samples convert exactly to tokens
    s = parse("--lr-decay-style WSD --lr-wsd-decay-style cosine --lr-wsd-decay-iters 3 --lr-warmup-iters 1").schedule
    assert (s.lr_decay_style, s.lr_wsd_decay_style, s.lr_wsd_decay_samples) == ("WSD", "cosine", 24)
    with pytest.raises(ConfigError, match="WSD needs the length of its final decay"):
        parse("--lr-decay-style WSD")
    with pytest.raises(ConfigError, match="need --lr-decay-style WSD"):
        parse("--lr-wsd-decay-iters 3")


def test_weight_decay_schedule_and_sgd_flags():
    o = parse("--weight-decay-incr-style cosine --start-weight-decay 0.01 --end-weight-decay 0.1").optim
    assert (o.start_weight_decay, o.end_weight_decay, o.weight_decay) == (0.01, 0.1, 0.1)
    with pytest.raises(ConfigError, match="needs both --start-weight-decay and --end-weight-decay"):
        parse("--weight-decay-incr-style linear --start-weight-decay 0.01")
    with pytest.raises(ConfigError, match="need --weight-decay-incr-style linear or cosine"):
        parse("--start-weight-decay 0.01 --end-weight-decay 0.1")
    with pytest.raises(ConfigError, match="--sgd-momentum needs --optimizer sgd"):
        parse("--sgd-momentum 0.5")
    from megazero.zero.config import ZeroConfigError, load_config

    try:
        load_config({"optimizer": {"type": "SGD", "params": {"momentum": 0.9}}})
    except ZeroConfigError:
        with pytest.raises(ConfigError, match="--optimizer sgd is not available in this build's ZeRO engine"):
            parse("--optimizer sgd")
    else:
        o = parse("--optimizer sgd --sgd-momentum 0.8").optim
        assert o.type == "SGD" and o.settings.momentum == 0.8


def test_run_control_flags():
    s = parse("--exit-duration-in-mins 5 --exit-signal-handler --skip-train").schedule
    assert (s.exit_duration_in_mins, s.exit_signal_handler, s.skip_train) == (5, True, True)
    with pytest.raises(ConfigError, match="contradict each other"):
        parse("--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler")
    with pytest.raises(ConfigError, match="--finetune needs --load"):
        parse("--finetune")
    cfg = parse("--save-interval 10")
    assert cfg.checkpoint.save_interval is None and cfg.notes == [
        "warning: --save-interval 10 without --save: no checkpoints will be written (as in Megatron)"]


def test_default_tokenizer_is_gpt2_bpe(dataset, gpt2_files):
    base = [a for a in TINY if a != "--mock-data"]
    with pytest.raises(ConfigError, match=r"missing required flags: --vocab-file and --merge-file \(the files of "
                                          r"GPT2BPETokenizer, the default --tokenizer-type\)"):
        parse(f"--data-path {dataset}", base=base)
    vocab, merges = gpt2_files
    cfg = parse(f"--data-path {dataset} {dataset} --vocab-file {vocab} --merge-file {merges}", base=base)
    assert cfg.data.tokenizer_type == "GPT2BPETokenizer" and cfg.data.weights is None  # by size


def test_model_flags_map_to_gpt_config_fields():
    """The mapping to the model's new fields (the GPTConfig fields of Megatron's model options)."""
    import dataclasses

    from megazero.model import GPTConfig
    from megazero.config.arguments import MODEL_FIELD_FLAGS

    fields = {f.name for f in dataclasses.fields(GPTConfig)}
    assert {name for name, _, _ in MODEL_FIELD_FLAGS} <= fields
    m = parse("--rotary-percent 0.5 --position-embedding-type rope --kv-channels 8 --qk-layernorm "
              "--apply-layernorm-1p --init-method-xavier-uniform --fp32-residual-connection "
              "--apply-query-key-layer-scaling").model
    assert (m.rotary_percent, m.kv_channels, m.qk_layernorm, m.apply_layernorm_1p, m.init_method,
            m.fp32_residual_connection, m.apply_query_key_layer_scaling) == (0.5, 8, True, True, "xavier_uniform",
                                                                           True, True)


def test_position_and_activation_aliases():
    m = parse("--use-rotary-position-embeddings --num-key-value-heads 2").model
    assert m.position_embedding_type == "rope" and m.num_query_groups == 2
    assert parse("--no-position-embedding").model.position_embedding_type == "none"
    assert parse("--squared-relu").model.activation == "squared_relu"


def test_remaining_model_flags_reach_gpt_config():
    m = parse("--squared-relu --norm-epsilon 1e-6 --label-smoothing 0.1 --no-query-key-layer-scaling").model
    assert (m.activation, m.layernorm_epsilon, m.label_smoothing, m.apply_query_key_layer_scaling) == \
        ("squared_relu", 1e-6, 0.1, False)
    assert parse("--layernorm-epsilon 1e-7").model.layernorm_epsilon == 1e-7
    assert parse("--no-position-embedding").model.position_embedding_type == "none"
    with pytest.raises(ConfigError, match=r"--label-smoothing must be in \[0, 1\)"):
        parse("--label-smoothing 1.5")


def test_vocab_padded_by_tp_as_megatron():
    # GPT-2's 50257 tokens: a multiple of 128 x tp (Megatron's _vocab_size_with_padding)
    assert parse("--vocab-size 50257", world=1).model.padded_vocab_size == 50304
    assert parse("--vocab-size 50257 --tp 4", world=4).model.padded_vocab_size == 50688
    m = parse("--vocab-size 50257 --tp 4 --make-vocab-size-divisible-by 2", world=4).model
    assert (m.padded_vocab_size, m.vocab_padding_tp) == (50264, 4)


def _fake_checkpoint(root, **model):
    it = root / "iter_0000005"
    it.mkdir(parents=True)
    (root / "latest").write_text("iter_0000005\n")
    (it / "config.json").write_text(json.dumps({"model": model}))
    return str(root)


def test_resume_keeps_the_saved_padded_vocabulary(tmp_path):
    load = _fake_checkpoint(tmp_path / "a", vocab_size=50257, make_vocab_size_divisible_by=128, vocab_padding_tp=2)
    cfg = parse(f"--vocab-size 50257 --tp 4 --load {load}", world=4)
    assert (cfg.model.padded_vocab_size, cfg.model.vocab_padding_tp) == (50432, 2)  # tp 2's padding, not 50688
    assert any("padded vocabulary 50432 kept" in n and "would pad to 50688" in n for n in cfg.notes)
    assert parse(f"--vocab-size 50257 --tp 2 --load {load}", world=4).notes == []  # same padding: nothing to say
    odd = _fake_checkpoint(tmp_path / "b", vocab_size=50257, make_vocab_size_divisible_by=1, vocab_padding_tp=1)
    with pytest.raises(ConfigError, match=r"padded vocabulary of 50257 rows .* does not split over --tp 2; resume "
                                          r"with a --tp that divides 50257"):
        parse(f"--vocab-size 50257 --tp 2 --load {odd}", world=4)
    # --finetune starts from the same weights: same rule; a directory without a checkpoint: fresh padding
    assert parse(f"--vocab-size 50257 --tp 4 --load {load} --finetune", world=4).model.padded_vocab_size == 50432
    assert parse(f"--vocab-size 50257 --tp 4 --load {tmp_path}", world=4).model.padded_vocab_size == 50688


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    from megazero.data.tokenizer_training import train_sentencepiece
    from tests.data.conftest import SAMPLE_TEXTS

    return train_sentencepiece(SAMPLE_TEXTS, str(tmp_path_factory.mktemp("spm") / "tiny"), 320, num_threads=1)


def test_megatron_tokenizer_types_and_vocab_extra_ids(spm_model):
    from megazero.data import build_tokenizer
    from megazero.config.arguments import TOKENIZER_TYPES

    assert {"GPTSentencePieceTokenizer", "Llama2Tokenizer", "HFTokenizer"} <= set(TOKENIZER_TYPES)
    base = [a for a in TINY if a != "--mock-data"] + ["--mock-data", "--tokenizer-model", spm_model]
    for name in ("GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        cfg = parse(f"--tokenizer-type {name}", base=base)
        assert cfg.data.tokenizer_type == name and cfg.model.vocab_size == 320
    cfg = parse("--tokenizer-type SentencePieceTokenizer --vocab-extra-ids 3", base=base)
    assert cfg.model.vocab_size == 323 and cfg.data.tokenizer_kwargs()["vocab_extra_ids"] == 3
    tok = build_tokenizer(cfg.data.tokenizer_type, **cfg.data.tokenizer_kwargs())  # what the trainer builds
    assert tok.vocab_size == 323 and tok.detokenize([322]) == "<extra_id_2>"
    with pytest.raises(ConfigError, match="--vocab-extra-ids 3: Megatron adds the <extra_id_N> sentinels to "
                                          "SentencePieceTokenizer only"):
        parse("--tokenizer-type GPTSentencePieceTokenizer --vocab-extra-ids 3", base=base)


def test_every_missing_required_flag_is_named_in_one_line():
    with pytest.raises(ConfigError) as e:
        parse_args("--model-preset gpt-tiny --mock-data".split(), 1)
    message = str(e.value)
    assert "\n" not in message and message.startswith("missing required flags: ")
    for flag in ("--micro-batch-size", "--lr", "--train-iters N (or --train-samples N)"):
        assert flag in message, message
    with pytest.raises(ConfigError) as e:
        parse_args([], 1)
    for flag in ("--num-layers", "--seq-length", "--micro-batch-size", "--lr", "--train-iters", "--data-path",
                 "--vocab-file and --merge-file"):
        assert flag in str(e.value), str(e.value)
    ds = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}}}
    with pytest.raises(ConfigError, match=r"missing required flags: --train-iters N \(or --train-samples N\)$"):
        _with_json(ds)  # the JSON's batch and lr count


def _with_json(ds):
    import os
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ds.json")
        with open(path, "w") as f:
            json.dump(ds, f)
        return parse_args(["--model-preset", "gpt-tiny", "--mock-data", "--deepspeed_config", path], 1)


@pytest.mark.parametrize("extra,named", [
    ("--data-path /nope/x", "--data-path"), ("--train-data-path /a --valid-data-path /b", "--train-data-path, --valid-data-path"),
    ("--data-cache-path /tmp/c", "--data-cache-path"), ("--split 98,1,1", "--split")])
def test_mock_data_refuses_the_file_data_flags_it_would_ignore(extra, named):
    with pytest.raises(ConfigError, match=rf"--mock-data trains on synthetic tokens and reads no files, so {named} "
                                          r"would be ignored; drop"):
        parse(extra, world=1)


def test_model_messages_name_flags_not_fields():
    with pytest.raises(ConfigError, match=r"^model config: --attention-dropout must be in \[0, 1\), got 1.5$"):
        parse("--attention-dropout 1.5", world=1)
    with pytest.raises(ConfigError, match=r"--rotary-percent 0.5 needs --position-embedding-type rope"):
        parse("--rotary-percent 0.5", world=1)


@pytest.mark.parametrize("extra,noted", [
    ("", True), ("--moe-aux-loss-coeff 1e-2", False), ("--moe-aux-loss-coeff 0", False),
    ("--moe-router-load-balancing-type none", False), ("--moe-expert-capacity-factor 1.5", False),
    ("--moe-router-score-function sigmoid --moe-router-enable-expert-bias", False),
    ("--moe-loss-coeff 0.1", False)])
def test_a_mixture_without_load_balancing_says_so_once(extra, noted):
    notes = [n for n in parse("--num-experts 4 " + extra, world=1).notes if "--moe-aux-loss-coeff defaults to 0" in n]
    assert len(notes) == (1 if noted else 0), notes
    assert not [n for n in parse(extra if "--moe" not in extra else "", world=1).notes if "load balancing" in n]
