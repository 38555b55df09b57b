"""Megatron-LM's launch lines of hybrid models (Mamba-2, Gated DeltaNet and attention layers) through pretrain_gpt.py's
flags, resolved before any process group starts: the GPTConfig each gives (real Megatron-LM argument lists in
tests/scripts), the pattern's rules (it gives --num-layers, its '|' cuts the pipeline), Megatron's older ways
(--hybrid-override-pattern, the ratios of a Mamba stack --spec, checked against megatron-core's allocation), what
stays refused and why, the checkpoint's model fields both ways, and the entry scripts. No model is built."""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys

import pytest
import torch

from megazero.config.arguments import describe, parse_args
from megazero.config.flag_rows import _layer_freq
from megazero.config.train_config import ConfigError
from megazero.model.config import GPTConfig
from megazero.model.interop.megatron_args import megatron_model_args
from megazero.model.interop.megatron_hybrid import hybrid_args, pattern_from_ratios
from megazero.model.interop.megatron_import import config_from_megatron_args
from megazero.model.pipeline_split import layers_per_chunk_table
from tests.cli.programs import ROOT
from tests.scripts.test_scripts_parse import script_args

RUN = ("--mock-data --micro-batch-size 1 --global-batch-size 8 --train-iters 10 --lr 1e-3 "
       "--tokenizer-type NullTokenizer --vocab-size 1023").split()
SHAPE = ("--hidden-size 64 --num-attention-heads 4 --seq-length 32 --max-position-embeddings 32 --mamba-head-dim 16 "
         "--mamba-num-groups 4").split()  # 8 Mamba-2 heads
NEMOTRON_H = "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-"


def parse(argv: list[str], world: int = 1):
    return parse_args(RUN + SHAPE + argv, world, check_files=False)


def refusal(argv: list[str], world: int = 1) -> str:
    with pytest.raises(ConfigError) as e:
        parse(argv, world)
    return str(e.value)


def without(argv: list[str], flags: set[str]) -> list[str]:
    """``argv`` without ``flags`` and their values."""
    kept, skip = [], False
    for word in argv:
        skip = word in flags if word.startswith("--") else skip
        kept += [] if skip else [word]
    return kept


def changed(model: GPTConfig) -> dict:
    """The GPTConfig fields a launch set (those other than the defaults, and the four required)."""
    return {f.name: getattr(model, f.name) for f in dataclasses.fields(GPTConfig)
            if f.name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size")
            or getattr(model, f.name) != f.default}


def test_nemotron_h_4b_launch_is_its_hybrid_stack():
    """Megatron-LM's Nemotron-H-4B arguments (tests/scripts/nemotron_h_4b.args): no --num-layers, the pattern gives
    the 52 layers."""
    argv = without(script_args("nemotron_h_4b"), {"--tokenizer-type", "--tokenizer-model"})
    cfg = parse_args(argv + RUN[:-4] + ["--tokenizer-type", "NullTokenizer", "--vocab-size", "131071", "--tp", "4"], 8,
                     check_files=False)
    assert changed(cfg.model) == dict(
        num_layers=52, hidden_size=3072, num_attention_heads=32, vocab_size=131072, ffn_hidden_size=12288,
        num_query_groups=8, kv_channels=128, max_position_embeddings=8192, seq_length=4096,
        position_embedding_type="rope", rotary_percent=0.5, normalization="rmsnorm", activation="squared_relu",
        add_bias_linear=False, tie_embeddings=False, hybrid_layer_pattern=NEMOTRON_H, mamba_num_heads=112,
        make_vocab_size_divisible_by=1, vocab_padding_tp=4, params_dtype=torch.bfloat16)
    kinds = [cfg.model.layer_kinds(i) for i in range(52)]
    assert [(k.mixer, k.mlp) for k in kinds[6:9]] == [("mamba", None), ("standard", None), (None, "dense")]
    assert describe(cfg).splitlines()[1] == (f"hybrid: 52 layers {NEMOTRON_H} (24 Mamba-2, 4 attention, 24 MLP); "
                                            "Mamba-2 112 heads x 64, state 128, 8 groups, conv 4")


def test_qwen3_next_style_launch_is_gated_deltanet_in_a_gpt():
    """Megatron-LM's Gated DeltaNet functional test (tests/scripts/gpt3_mcore_te_tp2_pp1_gdn.args): what megazero
    refuses is named in one message; without those flags it is GDN in layers 1-2 and 4-5, gated attention in 3 and 6."""
    argv = script_args("gpt3_mcore_te_tp2_pp1_gdn")
    with pytest.raises(ConfigError) as e:
        parse_args(argv + ["--vocab-size", "50257"], 2, check_files=False)
    named = sorted(line.split(":")[0].strip() for line in str(e.value).splitlines()[1:])
    assert named == ["--apply-wd-to-qk-layernorm", "--deterministic-mode",
                     "--transformer-impl transformer_engine"], str(e.value)
    kept = without(argv, {"--apply-wd-to-qk-layernorm", "--deterministic-mode", "--transformer-impl"})
    cfg = parse_args(kept + ["--vocab-size", "50257"], 2, check_files=False)
    assert changed(cfg.model) == dict(
        num_layers=6, hidden_size=512, num_attention_heads=8, vocab_size=50257, num_query_groups=2,
        max_position_embeddings=1024, seq_length=1024, position_embedding_type="rope", rotary_percent=0.5,
        activation="swiglu", apply_layernorm_1p=True, add_bias_linear=False, tie_embeddings=False, num_experts=32,
        moe_router_topk=8, moe_ffn_hidden_size=64, moe_shared_expert_intermediate_size=64, moe_shared_expert_gate=True,
        experimental_attention_variant="gated_delta_net", linear_attention_freq=3, linear_key_head_dim=64,
        linear_value_head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8, attention_output_gate=True,
        vocab_padding_tp=2, sequence_parallel=True, attention_backend="math", params_dtype=torch.bfloat16)
    assert [cfg.model.layer_kinds(i).mixer for i in range(6)] == ["gdn", "gdn", "standard"] * 2
    assert describe(cfg).splitlines()[1] == ("Gated DeltaNet in 4 of 6 layers (attention every 3 layers); 4 key heads "
                                            "x 64, 8 value heads x 64, conv 4; attention output gated")


KIMI_LINEAR = ["--num-layers", "8", "--experimental-attention-variant", "kda", "--linear-attention-freq", "4",
               "--linear-num-key-heads", "4", "--linear-num-value-heads", "4", "--linear-key-head-dim", "16",
               "--linear-value-head-dim", "16", "--kda-f-lora-rank", "16", "--kda-gate-lora-rank", "16"]


def test_kimi_linear_style_launch_is_kda_in_a_gpt():
    """Kimi Linear's layout by Megatron's names: KDA in 3 of every 4 layers, its low-rank decay and gate."""
    cfg = parse(KIMI_LINEAR + ["--tp", "2"], 2)
    m = cfg.model
    assert (m.experimental_attention_variant, m.kda_f_lora_rank, m.kda_gate_lora_rank) == ("kda", 16, 16)
    assert [m.layer_kinds(i).mixer for i in range(8)] == ["kda", "kda", "kda", "standard"] * 2
    assert m.recurrent
    assert describe(cfg).splitlines()[1] == ("KDA in 6 of 8 layers (attention every 4 layers); 4 heads x 16 (values "
                                            "16), conv 4, decay rank 16, gate rank 16")
    full = parse(KIMI_LINEAR[:-4]).model  # Megatron's default: full-rank projections
    assert (full.kda_f_lora_rank, full.kda_gate_lora_rank) == (None, None)


@pytest.mark.parametrize("argv, message", [
    (["--linear-num-value-heads", "8"], "KDA has one value head per key head: --linear-num-value-heads (8) must "
     "equal --linear-num-key-heads (4)"),
    (["--linear-num-key-heads", "2", "--linear-num-value-heads", "2"], "--linear-num-key-heads (2) must be divisible "
     "by the tensor parallel size (4): TP splits KDA by heads"),
    (["--kda-f-lora-rank", "0"], "--kda-f-lora-rank must be >= 1"),
])
def test_a_kda_model_that_cannot_build_is_one_line_naming_the_flags(argv, message):
    text = refusal(KIMI_LINEAR + argv + ["--tp", "4"], 4)
    assert message in text and "\n" not in text, text


def test_kda_is_not_a_hybrid_pattern_symbol():
    text = refusal(without(KIMI_LINEAR, {"--linear-attention-freq", "--num-layers"}) + ["--hybrid-layer-pattern", "G*"])
    assert "places KDA layers by --linear-attention-freq; a hybrid layer pattern has no KDA symbol" in text, text


def test_kda_heads_all_to_all_needs_the_heads_to_divide():
    text = refusal(KIMI_LINEAR + ["--tp", "2", "--context-parallel-size", "4", "--linear-cp-comm-type", "a2a"], 8)
    assert "splits each tensor-parallel rank's 2 key heads (--linear-num-key-heads 4 / --tp 2)" in text, text


def test_megatron_8b_mamba_example_allocates_its_layers_as_megatron_core():
    """Megatron-LM's examples/mamba/train.sh (8B): --hybrid-attention-ratio 0.08 --hybrid-mlp-ratio 0.5 under the
    Mamba stack --spec build megatron-core's allocate_layers(56, 0.08, 0.5)."""
    allocation = pytest.importorskip("megatron.core.ssm.mamba_hybrid_layer_allocation")
    cfg = parse_args(script_args("mamba_hybrid_8b") + ["--vocab-size", "256000"], 8, check_files=False)
    assert cfg.model.hybrid_layer_pattern == "".join(allocation.allocate_layers(56, 0.08, 0.5))
    assert (cfg.parallel.tp, cfg.model.num_layers, cfg.model.mamba_heads) == (4, 56, 128)
    for layers in (1, 7, 24, 56):
        for attention, mlp in ((0.0, 0.0), (0.08, 0.5), (0.25, 0.25), (0.5, 0.0), (0.0, 1.0), (0.3, 0.7)):
            assert pattern_from_ratios(layers, attention, mlp) == "".join(
                allocation.allocate_layers(layers, attention, mlp)), (layers, attention, mlp)


def test_the_pattern_gives_num_layers_and_a_different_one_is_one_line_naming_both():
    assert parse(["--hybrid-layer-pattern", "M*-M"]).model.num_layers == 4
    assert parse(["--hybrid-layer-pattern", "M*-M", "--num-layers", "4"]) == parse(["--hybrid-layer-pattern", "M*-M"])
    message = refusal(["--hybrid-layer-pattern", "M*-|M", "--num-layers", "5"])
    assert message == ("--num-layers 5 disagrees with --hybrid-layer-pattern M*-|M, which has 4 layers (its symbols "
                       "without '|'): give --num-layers 4 or leave it out")


def test_megatrons_older_names_and_ways():
    pattern = parse(["--hybrid-layer-pattern", "MM*-"])
    assert parse(["--hybrid-override-pattern", "MM*-"]) == pattern
    assert parse(["--hybrid-layer-pattern", "MM*-", "--is-hybrid-model"]) == pattern
    spec = ["--spec", "megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"]
    assert parse(["--hybrid-layer-pattern", "MM*-"] + spec) == pattern  # the layers come from the pattern
    assert parse(["--hybrid-layer-pattern", "MM*-", "--spec", "megatron.core.models.hybrid.hybrid_layer_specs",
                  "hybrid_stack_spec"]) == pattern
    assert parse(["--num-layers", "5"] + spec).model.hybrid_layer_pattern == "MMMMM"  # Megatron's ratios of 0
    assert parse(["--num-layers", "4", "--hybrid-attention-ratio", "0.25", "--hybrid-mlp-ratio", "0.25"]
                 + spec).model.hybrid_layer_pattern == "MM*-"
    # a pattern beside the ratios must have their counts (Megatron's older allocate_layers)
    assert parse(["--hybrid-layer-pattern", "MM*-", "--hybrid-attention-ratio", "0.25",
                  "--hybrid-mlp-ratio", "0.25"]) == pattern
    assert "drop the ratios" in refusal(["--hybrid-layer-pattern", "MM*-", "--hybrid-attention-ratio", "0.5"])
    assert refusal(["--hybrid-layer-pattern", "M*", "--hybrid-override-pattern", "M*"]) == (
        "--hybrid-override-pattern M* is Megatron's older name of --hybrid-layer-pattern M*: give one of them")
    assert "give --num-layers" in refusal(["--hybrid-attention-ratio", "0.5"])
    assert "--is-hybrid-model without a layer pattern: give the layers with --hybrid-layer-pattern" in refusal(
        ["--num-layers", "2", "--is-hybrid-model"])
    gdn = ["--num-layers", "4", "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq"]
    assert parse(gdn[:3] + ["gdn"] + gdn[4:] + ["2"]) == parse(gdn + ["2"])  # Megatron's newer name
    listed = parse(gdn + ["([1]+[0])*2"]).model  # Megatron's list expression, read without eval
    assert listed.linear_attention_freq == (1, 0, 1, 0)
    assert [listed.layer_kinds(i) for i in range(4)] == [parse(gdn + ["2"]).model.layer_kinds(i) for i in range(4)]


@pytest.mark.parametrize("text", ["([1]*3+[0])*12", "([1]*3+[0]*1)*3", "([0]+[1]*23)", "([1]*3+[0]*2)*2",
                                  "[1,0,1,0]", "[0]*3+[1]*58", "(([1]*2+[0])*2+[0])*2", "[1, 1, 0]"])
def test_megatrons_layer_lists_read_as_python_reads_them(text):
    """Megatron evaluates these with Python (its _eval_pattern); megazero parses them: the same 0/1 lists."""
    assert _layer_freq(text) == tuple(eval(text))  # the reference is Python itself, on these fixed strings


@pytest.mark.parametrize("text", ["[1,0", "([1]*3", "[1]*", "[1]]", "[1]*x", "__import__('os')", "[1,,0]"])
def test_a_layer_list_that_is_not_one_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="give an int or a list|each term is|after the list"):
        _layer_freq(text)


def test_a_gpt_without_these_flags_is_as_before():
    model = parse(["--num-layers", "2"]).model
    assert all(getattr(model, f.name) == f.default for f in dataclasses.fields(GPTConfig)
               if f.name in ("hybrid_layer_pattern", "experimental_attention_variant", "linear_attention_freq",
                             "attention_output_gate", "mamba_num_heads"))
    assert len(describe(parse(["--num-layers", "2"])).splitlines()) == 4  # model, parallel, batch, lr: no kinds line
    assert hybrid_args(model) == {"attention_output_gate": False}  # all a GPT's Megatron args gain


@pytest.mark.parametrize("argv, message", [
    (["--spec", "megatron.core.models.gpt.gpt_layer_specs", "get_gpt_layer_local_spec"],
     "--spec megatron.core.models.gpt.gpt_layer_specs get_gpt_layer_local_spec: layer specs given as Python import "
     "paths do not exist in megazero"),
    (["--experimental-attention-variant", "gdn2"], "Gated DeltaNet-2) does not exist in megazero; use gated_delta_net"),
    (["--experimental-attention-variant", "dsa"], "dsa: DeepSeek sparse attention does not exist in megazero"),
    (["--dsa-indexer-topk", "8"], "--dsa-indexer-topk: DeepSeek sparse attention (DSA, its indexer and its loss)"),
    (["--gdp-num-householder", "3"], "--gdp-num-householder: Gated DeltaProduct (several Householder steps per "
     "token) does not exist in megazero"),
    (["--mtp-hybrid-override-pattern", "M*"], "--mtp-hybrid-override-pattern: a hybrid pattern for the multi-token "
     "prediction modules does not exist"),
    (["--mamba-training-ssm-states-dtype", "bf16"], "--mamba-training-ssm-states-dtype bf16: the dtype of Mamba-2's "
     "states between chunks: megazero keeps them in fp32"),
    (["--heterogeneous-layers-config-path", "x.json"], "heterogeneous layers (a shape per layer, Llama-Nemotron) do "
     "not exist in megazero"),
])
def test_what_stays_refused_says_so_before_any_process_starts(argv, message):
    text = refusal(["--num-layers", "2"] + argv)
    assert text.startswith("refused before any process starts:") and message in text, text


def test_switches_accepted_with_no_effect():
    base = parse(["--hybrid-layer-pattern", "M-"])
    assert parse(["--hybrid-layer-pattern", "M-", "--disable-mamba-mem-eff-path",
                  "--mamba-training-ssm-states-dtype", "fp32"]) == base


@pytest.mark.parametrize("argv, message", [
    (["--hybrid-layer-pattern", "M*/MM"], "'/' is not built here: multi-token prediction depths are --mtp-num-layers"),
    (["--hybrid-layer-pattern", "MD"], "'D' is not built here: DeepSeek sparse attention (DSA) layers do not exist"),
    (["--hybrid-layer-pattern", "MX"], "'X' is not a layer symbol; use M (Mamba-2), G (Gated DeltaNet)"),
    (["--hybrid-layer-pattern", "M||M"], "has an empty pipeline segment"),
    (["--hybrid-layer-pattern", "ME"], "has mixture-of-experts layers (E): set --num-experts"),
    (["--hybrid-layer-pattern", "MG", "--linear-num-key-heads", "2"], "--linear-num-key-heads (2) must be divisible "
     "by the tensor parallel size (4)"),
    (["--hybrid-layer-pattern", "MG", "--linear-num-key-heads", "4", "--linear-num-value-heads", "6"],
     "--linear-num-value-heads (6) must be a multiple of --linear-num-key-heads (4)"),
    (["--hybrid-layer-pattern", "M-", "--mamba-num-groups", "2"], "--mamba-num-groups (2) must be divisible by the "
     "tensor parallel size (4)"),
    (["--hybrid-layer-pattern", "M-", "--mamba-head-dim", "48"], "2 x --hidden-size / --mamba-head-dim = 128 / 48, "
     "which does not divide: set --mamba-num-heads"),
    (["--num-layers", "4", "--linear-attention-freq", "2"], "--linear-attention-freq chooses Gated DeltaNet layers: "
     "set --experimental-attention-variant gated_delta_net"),
    (["--num-layers", "4", "--experimental-attention-variant", "gated_delta_net", "--linear-attention-freq", "[1,0,1]"],
     "--linear-attention-freq (1, 0, 1) must give one 0 (attention) or 1 (Gated DeltaNet) per layer: 4 values"),
    (["--num-layers", "4", "--experimental-attention-variant", "gated_delta_net"], "needs --linear-attention-freq"),
    (["--hybrid-layer-pattern", "M*", "--attention-output-gate", "--multi-latent-attention", "--qk-layernorm",
      "--position-embedding-type", "rope"], "--attention-output-gate is for standard attention"),
])
def test_a_model_that_cannot_build_is_one_line_naming_the_flags(argv, message):
    text = refusal(argv + ["--tp", "4"], 4)
    assert message in text and "\n" not in text, text


@pytest.mark.parametrize("pattern, pp, chunks", [
    ("M-M*|M-M-|MM*-|M-", 2, [[(0, 4), (4, 8)], [(8, 12), (12, 14)]]),  # 4 segments at pp 2: 2 chunks per rank
    ("M-M*|M-M-", 2, [[(0, 4), (4, 8)]]),
    ("M-M*M-M-", 2, [[(0, 4), (4, 8)]]),  # no cut: the even split
])
def test_the_patterns_cuts_place_each_virtual_stage(pattern, pp, chunks):
    cfg = parse(["--hybrid-layer-pattern", pattern, "--pp", str(pp)], pp)
    p = cfg.parallel
    table = layers_per_chunk_table(cfg.model.num_layers, p.pp, p.virtual_pp, None, None, cfg.model.pipeline_segments)
    assert [[(r.start, r.stop) for r in chunk] for chunk in table] == chunks
    assert p.virtual_pp == len(chunks)


@pytest.mark.parametrize("argv, message", [
    ([], "--hybrid-layer-pattern M-|M-|M- has 3 pipeline segments ('|' cuts) for --pp 2: cut it into a multiple of 2 "
         "segments"),
    (["--decoder-first-pipeline-num-layers", "2"], None),
    (["--account-for-embedding-in-pipeline-split"], None),
    (["--virtual-pipeline-model-parallel-size", "1"], None),
    (["--num-layers-per-virtual-pipeline-stage", "1"], None),
])
def test_the_patterns_cuts_refuse_another_split(argv, message):
    pattern = "M-|M-|M-" if message else "M-|M-|M-|M-"
    text = refusal(["--hybrid-layer-pattern", pattern, "--pp", "2"] + argv, 2)
    assert (message or f"{argv[0]}") in text and "\n" not in text, text
    if message is None:
        assert text.endswith("beside the '|' cuts of --hybrid-layer-pattern, which place every stage's layers (4 "
                             "segments / --pp 2 = 2 chunks per rank): drop it, or the cuts"), text


@pytest.mark.parametrize("fields", [
    dict(hybrid_layer_pattern="M-*-|MG-E|M*-E", num_layers=12, num_experts=4, moe_ffn_hidden_size=128,
         mamba_num_heads=4, mamba_num_groups=2, mamba_head_dim=32, mamba_state_dim=16, linear_conv_kernel_dim=3,
         linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=8,
         attention_output_gate=True),
    dict(num_layers=4, experimental_attention_variant="gated_delta_net", linear_attention_freq=(1, 0, 1, 0),
         linear_num_key_heads=2, linear_num_value_heads=2),
    dict(num_layers=4, experimental_attention_variant="gated_delta_net", linear_attention_freq=4),
    dict(num_layers=4, experimental_attention_variant="kda", linear_attention_freq=4, linear_num_key_heads=2,
         linear_num_value_heads=2, kda_f_lora_rank=16),
])
def test_megatron_arguments_carry_the_layer_kinds_both_ways(fields):
    """What a torch_dist save writes as Megatron-LM's args gives the same model back, and so does GPTConfig's own
    dict (megazero's checkpoints)."""
    model = GPTConfig(hidden_size=64, num_attention_heads=4, vocab_size=128, ffn_hidden_size=256, **fields).validate()
    args = megatron_model_args(model)
    assert config_from_megatron_args(argparse.Namespace(**args), 128) == model
    assert GPTConfig.from_dict(json.loads(json.dumps(model.to_dict()))) == model
    if model.hybrid_layer_pattern is not None:
        assert (args["is_hybrid_model"], args["hybrid_override_pattern"]) == (True, "M-*-MG-EM*-E")


def test_megatrons_older_hybrid_arguments_read_as_their_pattern():
    gpt = megatron_model_args(GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=128))
    older = dict(gpt, hybrid_override_pattern="M*M-")
    assert config_from_megatron_args(argparse.Namespace(**older)).hybrid_layer_pattern == "M*M-"
    ratios = dict(gpt, hybrid_attention_ratio=0.25, hybrid_mlp_ratio=0.25,
                  spec=["megatron.core.models.mamba.mamba_layer_specs", "mamba_stack_spec"])
    assert config_from_megatron_args(argparse.Namespace(**ratios)).hybrid_layer_pattern == "MM*-"
    plain = dict(gpt, hybrid_attention_ratio=0.0, hybrid_mlp_ratio=0.0, spec=None)  # an older GPT's defaults
    assert config_from_megatron_args(argparse.Namespace(**plain)).hybrid_layer_pattern is None


def _full_checkpoint(tmp_path, model: GPTConfig) -> str:
    """A directory read as a full checkpoint (the weights file is not read before the run)."""
    (tmp_path / "model_full.safetensors").write_bytes(b"")
    (tmp_path / "config.json").write_text(json.dumps(model.to_dict()))
    return str(tmp_path)


def test_a_run_from_a_hybrid_checkpoint_takes_its_layers_and_may_cut_them_anew(tmp_path):
    model = parse(["--hybrid-layer-pattern", "MG*-", "--mamba-num-heads", "4", "--linear-num-key-heads", "2",
                   "--linear-num-value-heads", "4", "--attention-output-gate"]).model
    load = ["--pretrained-checkpoint", _full_checkpoint(tmp_path, model), "--use-checkpoint-args"]
    run = parse_args(RUN + load, 1, check_files=True).model
    assert run == dataclasses.replace(model, vocab_padding_tp=run.vocab_padding_tp)
    recut = parse_args(RUN + load + ["--hybrid-layer-pattern", "MG|*-", "--pp", "2"], 2, check_files=True)
    assert recut.model.hybrid_layer_pattern == "MG|*-" and recut.parallel.virtual_pp == 1
    with pytest.raises(ConfigError, match=r"--hybrid-layer-pattern MGG- disagrees with the checkpoint's "
                                          r"--hybrid-layer-pattern MG\*- "):
        parse_args(RUN + load + ["--hybrid-layer-pattern", "MGG-"], 1, check_files=True)
    with pytest.raises(ConfigError, match="--mamba-num-heads 8 disagrees with the checkpoint's --mamba-num-heads 4 "):
        parse_args(RUN + load + ["--mamba-num-heads", "8"], 1, check_files=True)


@pytest.mark.parametrize("script", ["pretrain_hybrid.py", "pretrain_mamba.py"])
def test_megatrons_hybrid_entry_scripts_are_pretrain_gpt(script):
    assert (ROOT / script).read_text().count("from megazero.cli.pretrain_gpt import main") == 1
    run = subprocess.run([sys.executable, str(ROOT / script), "--help"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "--hybrid-layer-pattern" in run.stdout and "--mamba-num-heads" in run.stdout
