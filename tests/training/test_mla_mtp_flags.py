"""Megatron-LM's multi-latent attention, YaRN and multi-token prediction flags: the DeepSeek-V3 and Moonlight
launch flags parse to the intended GPTConfig and layout, and bad values stop pretrain_gpt.py's argument path
with one line naming the value and the fix, before any process group starts."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys

import pytest

from megazero.config import ConfigError, parse_args, parse_args_or_exit
from megazero.config.arguments import build_parser
from megazero.config.train_config import DataConfig
from megazero.config.flags import FLAGS, _shown
from tests.launch import ROOT

# Megatron-MoE-ModelZoo (the model zoo Megatron-LM's MoE README points to) model_configs/benchmarking/DeepSeek-V3.yaml
# MODEL_ARGS (commit 31942f09; a `true` is the bare switch, a `false` leaves the flag out), then the H100 line of
# best_practice/DeepSeekV3/run.sh (commit c1ad0b5c). Flag for flag except: sizes shrunk (61 layers -> 4 with the
# pattern ([0]*3+[1]*58) -> ([0]*1+[1]*3), hidden 7168 -> 64, ffn 18432 -> 192, heads 128 -> 4, kv-channels 128 ->
# 16, seq 4096 -> 64, experts 256 -> 8, their width 2048 -> 32, top-8 of 8 groups' best 4 -> top-4 of 4 groups' best
# 2, q/kv latents 1536/512 -> 48/16, qk/pos/v heads 128/64/128 -> 16/8/16, the layout's 30 chunk pairs -> 1), the
# sample counts shrunk, TP 2 PP 8 EP 64 -> TP 2 PP 2 EP 4 on 16 ranks, paths -> {placeholders}; --vocab-size added
# (the tokenizer is not read when files are not checked).
DEEPSEEK_V3 = """
--distributed-timeout-minutes 60 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2
--expert-model-parallel-size 4 --context-parallel-size 1 --expert-tensor-parallel-size 1 --use-distributed-optimizer
--overlap-grad-reduce --overlap-param-gather
--use-mcore-models --sequence-parallel --use-flash-attn --disable-bias-linear --micro-batch-size 1
--global-batch-size 16 --train-samples 64 --exit-duration-in-mins 220 --no-save-optim
--no-check-for-nan-in-loss-and-grad --cross-entropy-loss-fusion --cross-entropy-fusion-impl native --manual-gc
--manual-gc-interval 10
--transformer-impl transformer_engine
--seq-length 64 --data-cache-path {WORKSPACE}/data_cache --tokenizer-type HuggingFaceTokenizer
--tokenizer-model unsloth/DeepSeek-V3 --data-path {DATA} --split 99,1,0 --no-mmap-bin-files
--no-create-attention-mask-in-dataloader --num-workers 6
--num-layers 4 --hidden-size 64 --ffn-hidden-size 192 --num-attention-heads 4 --kv-channels 16
--max-position-embeddings 64 --position-embedding-type rope --rotary-base 10000 --make-vocab-size-divisible-by 3232
--normalization RMSNorm --norm-epsilon 1e-6 --swiglu --untie-embeddings-and-output-weights --multi-latent-attention
--attention-dropout 0.0 --hidden-dropout 0.0 --clip-grad 1.0 --weight-decay 0.1 --qk-layernorm
--lr-decay-samples 60 --lr-warmup-samples 16 --lr-warmup-init 3.9e-7 --lr 3.9e-6 --min-lr 3.9e-7
--lr-decay-style cosine --adam-beta1 0.9 --adam-beta2 0.95
--num-experts 8 --moe-layer-freq ([0]*1+[1]*3) --moe-ffn-hidden-size 32 --moe-shared-expert-intermediate-size 32
--moe-router-load-balancing-type seq_aux_loss --moe-router-topk 4 --moe-grouped-gemm --moe-aux-loss-coeff 1e-4
--moe-router-group-topk 2 --moe-router-num-groups 4 --moe-router-topk-scaling-factor 2.5
--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-3
--moe-router-dtype fp32 --moe-permute-fusion --moe-router-fusion
--q-lora-rank 48 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16
--rotary-scaling-factor 40 --mscale 1.0 --mscale-all-dim 1.0
--eval-iters 32 --eval-interval 200
--no-load-optim --no-load-rng --auto-detect-ckpt-format --load {LOAD} --save {CKPT} --save-interval 500
--dist-ckpt-strictness log_all --init-method-std 0.02
--log-timers-to-tensorboard --log-memory-to-tensorboard --log-validation-ppl-to-tensorboard --log-throughput
--log-interval 1 --logging-level 40 --tensorboard-dir {TB} --wandb-project {WANDB}
--wandb-exp-name DeepSeek-V3-TP2PP2EP4CP1VPP1-MBS1GBS16- --bf16 --enable-experimental
--vocab-size 129280
--recompute-granularity selective --recompute-modules mla_up_proj mlp
--mtp-num-layers 1 --mtp-loss-scaling-factor 0.1 --pipeline-model-parallel-layout Et|tt|t|mL
"""

# THUDM/slime scripts/models/moonlight.sh MODEL_ARGS (Megatron-LM flags for moonshotai/Moonlight-16B-A3B), its
# layer pattern as the script prints it, then a run's flags and NeMo-RL's Moonlight layout (TP 2, PP 1, EP 8,
# ETP 1, with the sequence parallelism an expert tensor-parallel size other than TP needs) on 16 ranks. Flag for
# flag except: sizes shrunk (27 layers -> 3, hidden 2048 -> 64, ffn 11264 -> 352, heads 16 -> 4, kv-channels 128
# -> 16, vocabulary 163840 -> 1280, kv latent 512 -> 32, qk/pos/v heads 128/64/128 -> 16/8/16, experts 64 -> 8,
# their width 1408 -> 44 (2 shared: 88), top-6 -> top-2).
MOONLIGHT = """
--disable-bias-linear --num-layers 3 --hidden-size 64 --ffn-hidden-size 352 --num-attention-heads 4 --kv-channels 16
--normalization RMSNorm --position-embedding-type rope --norm-epsilon 1e-5 --rotary-percent 1.0 --swiglu
--untie-embeddings-and-output-weights --no-masked-softmax-fusion --vocab-size 1280
--multi-latent-attention --kv-lora-rank 32 --qk-head-dim 16 --qk-pos-emb-head-dim 8 --v-head-dim 16 --qk-layernorm
--rotary-scaling-factor 1 --rotary-base 50000 --mscale 1.0 --mscale-all-dim 1.0 --attention-softmax-in-fp32
--no-rope-fusion
--num-experts 8 --moe-layer-freq [0,1,1] --moe-ffn-hidden-size 44 --moe-router-topk 2
--moe-shared-expert-intermediate-size 88 --moe-router-pre-softmax --moe-router-score-function sigmoid
--moe-router-enable-expert-bias --moe-router-load-balancing-type seq_aux_loss --moe-token-dispatcher-type alltoall
--moe-aux-loss-coeff 0 --moe-router-bias-update-rate 0 --moe-router-group-topk 1 --moe-router-num-groups 1
--moe-grouped-gemm --moe-router-topk-scaling-factor 2.446 --moe-token-drop-policy probs --moe-router-dtype fp32
--moe-permute-fusion
--micro-batch-size 1 --global-batch-size 8 --train-iters 2 --lr 1e-5 --seq-length 64 --mock-data --bf16
--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --expert-model-parallel-size 8
--expert-tensor-parallel-size 1 --sequence-parallel
"""


def args(text: str) -> list[str]:
    for key in ("WORKSPACE", "DATA", "LOAD", "CKPT", "TB", "WANDB"):
        text = text.replace("{" + key + "}", f"/nonexistent/{key.lower()}")
    return shlex.split(text)


def substituted(argv: list[str], values: dict[str, list[str]]) -> list[str]:
    """``argv`` with each flag of ``values`` and its own words replaced by the words given (none: dropped); every
    flag named must be in ``argv``."""
    out, i, missing = [], 0, set(values)
    while i < len(argv):
        flag = argv[i]
        end = i + 1
        while end < len(argv) and not argv[end].startswith("--"):
            end += 1
        if flag in values:
            missing.discard(flag)
            out += values[flag]
        else:
            out += argv[i:end]
        i = end
    assert not missing, sorted(missing)
    return out


def fields(config, **expected) -> None:
    m, p = config.model, config.parallel
    got = {k: getattr(p, k) if hasattr(p, k) and not hasattr(m, k) else getattr(m, k) for k in expected}
    assert got == expected


MLA_TINY = dict(multi_latent_attention=True, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, qk_dim=24, v_dim=16,
                qk_layernorm=False, num_query_groups=None, position_embedding_type="rope", normalization="rmsnorm",
                activation="swiglu", add_bias_linear=False, tie_embeddings=False, hidden_size=64,
                num_attention_heads=4, kv_channels=16, resolved_rope_type="yarn", mscale=1.0, mscale_all_dim=1.0,
                original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0, num_experts=8,
                moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True,
                moe_router_load_balancing_type="seq_aux_loss", moe_grouped_gemm=True)


def test_deepseek_v3_flags_name_what_megazero_refuses():
    with pytest.raises(ConfigError) as e:
        parse_args(args(DEEPSEEK_V3), 16, check_files=False)
    text = str(e.value)
    assert "--no-save-optim:" in text and "--transformer-impl transformer_engine:" in text
    assert "--pipeline-model-parallel-layout:" in text and "--decoder-first-pipeline-num-layers" in text
    assert "--multi-latent-attention" not in text and "--mtp-num-layers" not in text


def _deepseek_v3(**more: list[str]) -> list[str]:
    return substituted(args(DEEPSEEK_V3), {"--no-save-optim": [], "--transformer-impl": ["--transformer-impl", "local"],
                                           "--pipeline-model-parallel-layout": ["--decoder-first-pipeline-num-layers",
                                                                                "1", "--decoder-last-pipeline-num-"
                                                                                "layers", "3"], **more})


def test_deepseek_v3_refuses_recompute_modules_but_core_attention():
    with pytest.raises(ConfigError, match=r"--recompute-modules mla_up_proj mlp: megazero's selective recompute "
                                          r"recomputes core attention only .* --recompute-granularity full"):
        parse_args(_deepseek_v3(), 16, check_files=False)


def test_deepseek_v3_parses_to_its_model_and_layout():
    config = parse_args(_deepseek_v3(**{"--recompute-modules": ["--recompute-modules", "core_attn"]}), 16,
                        check_files=False)
    fields(config, **MLA_TINY, num_layers=4, ffn_hidden_size=192, q_lora_rank=48, kv_lora_rank=16,
           rotary_scaling_factor=40.0, rotary_base=10000.0, layernorm_epsilon=1e-6, moe_ffn_hidden_size=32,
           moe_shared_expert_intermediate_size=32, moe_router_topk=4, moe_router_num_groups=4,
           moe_router_group_topk=2, moe_router_topk_scaling_factor=2.5, moe_aux_loss_coeff=1e-4,
           mtp_num_layers=1, mtp_loss_scaling_factor=0.1, vocab_size=129280, attention_backend="flash",
           recompute_granularity="selective", hidden_dropout=0.0, attention_dropout=0.0,
           tp=2, pp=2, ep=4, etp=1, cp=1, dp=4, zero_stage=1, sequence_parallel=True,
           decoder_first_pipeline_num_layers=1, decoder_last_pipeline_num_layers=3)
    assert [i for i in range(4) if config.model.is_moe_layer(i)] == [1, 2, 3]
    assert any("--kv-channels 16: no effect under --multi-latent-attention" in n for n in config.notes)


def test_deepseek_v3_at_its_own_sizes_on_1024_gpus():
    real = ("--num-layers 61 --hidden-size 7168 --ffn-hidden-size 18432 --num-attention-heads 128 --kv-channels 128 "
            "--seq-length 4096 --max-position-embeddings 4096 --num-experts 256 --moe-layer-freq ([0]*3+[1]*58) "
            "--moe-ffn-hidden-size 2048 --moe-shared-expert-intermediate-size 2048 --moe-router-topk 8 "
            "--moe-router-group-topk 4 --moe-router-num-groups 8 --q-lora-rank 1536 --kv-lora-rank 512 "
            "--qk-head-dim 128 --qk-pos-emb-head-dim 64 --v-head-dim 128 --pipeline-model-parallel-size 8 "
            "--expert-model-parallel-size 64 --global-batch-size 8192 --train-samples 585937500 "
            "--decoder-first-pipeline-num-layers 7 --decoder-last-pipeline-num-layers 6").split()
    values = {flag: [flag, value] for flag, value in zip(real[::2], real[1::2])}
    argv = substituted(_deepseek_v3(), {**values, "--recompute-modules": []})
    config = parse_args(argv, 1024, check_files=False)
    m = config.model
    assert (m.qk_dim, m.v_dim, m.q_lora_rank, m.kv_lora_rank, m.resolved_rope_type, m.rotary_scaling_factor) == (
        192, 128, 1536, 512, "yarn", 40.0)
    assert (m.mtp_num_layers, m.padded_vocab_size) == (1, 129280)
    fields(config, tp=2, pp=8, ep=64, etp=1, dp=64, decoder_first_pipeline_num_layers=7,
           decoder_last_pipeline_num_layers=6)


def test_moonlight_parses_to_its_model_and_layout():
    config = parse_args(args(MOONLIGHT), 16, check_files=False)
    fields(config, **MLA_TINY, num_layers=3, ffn_hidden_size=352, q_lora_rank=None, kv_lora_rank=32,
           rotary_scaling_factor=1.0, rotary_base=50000.0, layernorm_epsilon=1e-5, vocab_size=1280,
           moe_ffn_hidden_size=44, moe_shared_expert_intermediate_size=88, moe_router_topk=2,
           moe_router_pre_softmax=True,
           moe_router_num_groups=1, moe_router_group_topk=1, moe_router_topk_scaling_factor=2.446,
           moe_router_bias_update_rate=0.0, moe_aux_loss_coeff=0.0, mtp_num_layers=0,
           tp=2, pp=1, ep=8, etp=1, cp=1, dp=8, sequence_parallel=True,
           decoder_first_pipeline_num_layers=None, decoder_last_pipeline_num_layers=None)
    assert [i for i in range(3) if config.model.is_moe_layer(i)] == [1, 2]


BASE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 1 --lr 1e-3 "
        "--train-iters 2 --mock-data --vocab-size 128")
MLA = BASE + " --position-embedding-type rope --multi-latent-attention --qk-layernorm"


@pytest.mark.parametrize("flags, expected", [
    ("--rope-type rope", dict(resolved_rope_type="rope", rotary_scaling_factor=1.0, kv_lora_rank=32,
                              qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128, q_lora_rank=None)),
    ("--q-lora-rank 0 --rotary-scaling-factor 4 --yarn-original-max-position-embeddings 8 --yarn-beta-fast 16 "
     "--yarn-beta-slow 2", dict(q_lora_rank=None, resolved_rope_type="yarn", rotary_scaling_factor=4.0,
                                original_max_position_embeddings=8, beta_fast=16.0, beta_slow=2.0, mscale_all_dim=0.0)),
    ("--num-query-groups 2 --mtp-num-layers 2 --mtp-loss-scaling-factor 0.3",
     dict(num_query_groups=None, query_groups=4, mtp_num_layers=2, mtp_loss_scaling_factor=0.3)),
])
def test_mla_flags_and_megatron_defaults(flags, expected):
    config = parse_args(shlex.split(MLA + " " + flags), 1, check_files=False)
    fields(config, **expected)


_GROUP = "multi-latent attention, RoPE scaling and multi-token prediction"


@pytest.mark.parametrize("flag", [f for f in FLAGS if f.group == _GROUP and f.default is not None],
                         ids=lambda f: f.names[0])
@pytest.mark.parametrize("base", [BASE + " --position-embedding-type rope", MLA], ids=["rope", "mla"])
def test_the_default_shown_is_the_one_in_force_with_latents_or_without(flag, base):
    without = parse_args(shlex.split(base), 1, check_files=False)
    given = parse_args(shlex.split(base) + [flag.names[0], _shown(flag.default)], 1, check_files=False)
    assert dataclasses.replace(given, notes=[]) == dataclasses.replace(without, notes=[])


def test_yarn_without_latents_is_the_position_embedding_type():
    config = parse_args(shlex.split(BASE + " --position-embedding-type yarn --rotary-scaling-factor 8"), 1,
                        check_files=False)
    fields(config, multi_latent_attention=False, position_embedding_type="rope", resolved_rope_type="yarn",
           rotary_scaling_factor=8.0, original_max_position_embeddings=4096)
    plain = parse_args(shlex.split(BASE + " --position-embedding-type rope --rotary-scaling-factor 1"), 1,
                       check_files=False)
    assert plain.model.resolved_rope_type == "rope"


# (the flags after BASE, a piece of the one-line message): sizes, YaRN and MTP values that cannot run.
BAD = [
    (MLA + " --qk-pos-emb-head-dim 7", "--qk-pos-emb-head-dim (7) must be even and >= 2"),
    (MLA + " --qk-head-dim 0", "--qk-head-dim must be >= 1, got 0"),
    (MLA + " --v-head-dim 0", "--v-head-dim must be >= 1, got 0"),
    (MLA + " --kv-lora-rank 0", "--kv-lora-rank must be >= 1, got 0"),
    (MLA + " --q-lora-rank -4", "--q-lora-rank must be >= 1 (the query latent's rank), or 0 or not given"),
    (MLA + " --tensor-model-parallel-size 3", "--num-attention-heads (4) must be divisible by the tensor parallel"),
    (MLA + " --rope-type yarn", "--rope-type yarn without --rotary-scaling-factor"),
    (MLA + " --rotary-scaling-factor 0", "YaRN needs --rotary-scaling-factor > 0"),
    (BASE + " --position-embedding-type yarn", "--position-embedding-type yarn without --rotary-scaling-factor"),
    (BASE + " --position-embedding-type rope --rope-type yarn --rotary-scaling-factor 4",
     "--rope-type yarn without --multi-latent-attention: Megatron asserts"),
    (BASE + " --position-embedding-type rope --rotary-scaling-factor 40", "--rotary-scaling-factor 40 needs YaRN"),
    (MLA + " --mtp-num-layers 32", "--seq-length (32) must be >= 33"),
    (MLA + " --mtp-num-layers 1 --mtp-loss-scaling-factor -0.5", "--mtp-loss-scaling-factor must be >= 0, got -0.5"),
    (MLA + " --mtp-num-layers -1", "--mtp-num-layers must be >= 0, got -1"),
    (BASE + " --mtp-num-layers 1", "needs --position-embedding-type rope or none"),
    (BASE + " --mtp-loss-scaling-factor 0.3", "needs --mtp-num-layers D"),
    (BASE + " --multi-latent-attention --qk-layernorm", "needs --position-embedding-type rope"),
    (BASE + " --position-embedding-type rope --multi-latent-attention", "add --qk-layernorm"),
    (MLA + " --group-query-attention --num-query-groups 2", "drop --group-query-attention"),
    (BASE + " --kv-lora-rank 64", "--kv-lora-rank 64 sizes multi-latent attention: add --multi-latent-attention"),
]


@pytest.mark.parametrize("flags, message", BAD, ids=[m.split(":")[0][:40] for _, m in BAD])
def test_bad_values_stop_pretrain_gpt_with_one_line(flags, message, capsys, monkeypatch):
    """parse_args_or_exit is pretrain_gpt.py's first step: exit 2, one error line, no process group."""
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    world = 3 if "--tensor-model-parallel-size 3" in flags else 1
    with pytest.raises(SystemExit) as e:
        parse_args_or_exit(shlex.split(flags), world, check_files=False)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1 and message in lines[0], err


def test_pretrain_gpt_program_refuses_before_any_process_group():
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR")}
    proc = subprocess.run([sys.executable, "pretrain_gpt.py", *shlex.split(MLA + " --qk-pos-emb-head-dim 7")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
    assert proc.returncode == 2 and lines[-1].endswith("--qk-pos-emb-head-dim (7) must be even and >= 2: RoPE rotates "
                                                       "pairs"), proc.stderr
    assert not any("process group" in ln.lower() for ln in lines), proc.stderr



def test_the_start_up_line_names_the_latents_yarn_and_mtp():
    from megazero.config import describe

    line = describe(parse_args(shlex.split(MLA + " --q-lora-rank 32 --rotary-scaling-factor 40 --mtp-num-layers 1"), 1,
                               check_files=False)).splitlines()[0]
    assert "4 heads (multi-latent: q latent 32, kv latent 32, qk 128+64, v 128)" in line
    assert "(YaRN x40)" in line and line.endswith("; 1 multi-token prediction module (weight 0.1)")


def test_a_checkpoints_latents_and_mtp_refuse_a_flag_that_disagrees():
    """From a checkpoint (--use-checkpoint-args) the MLA/YaRN/MTP fields are the saved ones; a flag typed with
    another value is refused by both values, one given as the saved one is not."""
    from megazero.config.resolve.model import given_model_fields
    from megazero.config.resolve.resume import checkpoint_model_kwargs

    saved = parse_args(shlex.split(MLA + " --kv-lora-rank 16 --rotary-scaling-factor 40 --mtp-num-layers 1"), 1,
                       check_files=False).model.to_dict()

    def given(flags: str):
        ns = build_parser().parse_args(shlex.split(BASE + " " + flags))
        return given_model_fields(ns, None, "layernorm_epsilon", DataConfig())

    kept = checkpoint_model_kwargs(saved, given("--multi-latent-attention --qk-layernorm --kv-lora-rank 16 "
                                                "--rope-type yarn --rotary-scaling-factor 40"), "ckpt")
    assert (kept["multi_latent_attention"], kept["kv_lora_rank"], kept["mtp_num_layers"]) == (True, 16, 1)
    for flags, message in (("--multi-latent-attention --qk-layernorm --kv-lora-rank 32", "--kv-lora-rank 32 disagrees"),
                           ("--mtp-num-layers 2", "--mtp-num-layers 2 disagrees"),
                           ("--rope-type rope", "--rope-type rope disagrees")):
        with pytest.raises(ConfigError, match=message):
            checkpoint_model_kwargs(saved, given(flags), "ckpt")
