"""Every flag of Megatron-LM's newest arguments.py (tests/training/megatron_lm_flags.txt, written by
scripts/megatron_flag_list.py from Megatron-LM's own parser) is answered by pretrain_gpt.py: honoured, mapped, or
refused with the megazero way; a new Megatron-LM release's flags fail here, not in a user's launch. Each answer
is checked for what it claims: a refusal stops the run naming the flag, a flag accepted with no effect leaves
the run's configuration as it was, and the honoured ones do what Megatron does (the pipeline split against
megatron-core's, the gradient dtypes against the DeepSpeed JSON keys of the same meaning)."""

from __future__ import annotations

import dataclasses
import json
import os
import re

import pytest

from megazero.config.arguments import build_parser, parse_args
from megazero.config.train_config import ConfigError
from megazero.config.flags import FLAGS, MAPPED, REFUSED
from tests.scripts.test_scripts_parse import script_args

HERE = os.path.dirname(os.path.abspath(__file__))
LIST = os.path.join(HERE, "megatron_lm_flags.txt")
TINY = ("--mock-data --num-layers 4 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
        "--max-position-embeddings 32 --micro-batch-size 1 --global-batch-size 4 --train-iters 10 --lr 1e-3 "
        "--tokenizer-type NullTokenizer --vocab-size 100").split()
PARSER = build_parser()


def megatron_flags() -> list[tuple[str, int, list[str]]]:
    """``(flag, how many values Megatron gives it, Megatron's choices)`` of each line of the list (``values``,
    one or more: 2)."""
    out = []
    for line in open(LIST):
        if not line.startswith("#"):
            flag, kind, *choices = line.split()
            count = {"switch": 0, "value": 1, "values": 2}[kind] if not kind.isdigit() else int(kind)
            out.append((flag, count, choices[0].split(",") if choices else []))
    return out


def parse(argv: list[str], world: int = 1):
    return parse_args(TINY + argv, world, check_files=False, parser=PARSER)


def words(flag: str, count: int, choices: list[str], first: int = 0) -> list[str]:
    """``flag`` with ``count`` values Megatron takes: its choices from ``first`` on, else one megazero has."""
    action = PARSER._option_string_actions[flag]
    pool = choices or [str(c) for c in action.choices or ()] or ["1"]
    return [flag] + [pool[(first + i) % len(pool)] for i in range(count)]


def sample(flag: str, count: int, choices: list[str]) -> list[str]:
    """``flag`` as a script most often gives it (a list flag with one value)."""
    return words(flag, 1 if count == 2 else count, choices)


def test_the_list_is_megatron_lms_and_says_which_commit():
    header = open(LIST).readline()
    assert re.search(r"NVIDIA/Megatron-LM [0-9a-f]{40} \d{4}-\d\d-\d\d", header), header
    flags = [f for f, _, _ in megatron_flags()]
    assert len(flags) == len(set(flags)) > 800
    assert {"--calculate-per-token-loss", "--hybrid-override-pattern", "--rerun-mode", "--use-megatron-fsdp",
            "--kitchen-config-file"} <= set(flags)


def test_every_megatron_lm_flag_has_an_answer():
    answered = {name: f.status for f in FLAGS for name in f.names}
    missing = [flag for flag, _, _ in megatron_flags()
               if flag not in answered or flag not in PARSER._option_string_actions]
    assert not missing, f"Megatron-LM flags pretrain_gpt.py does not answer (add rows to the flag table): {missing}"


def test_each_flag_takes_what_megatron_gives_it():
    """A Megatron switch parses alone, a value flag takes its value (a list flag two), and every choice Megatron
    offers parses: to be honoured, or refused by value with a message, never an argparse error."""
    wrong = []
    for flag, count, choices in megatron_flags():
        for first in range(max(len(choices), 1)):
            argv = words(flag, count, choices, first)
            try:
                ns = PARSER.parse_args(argv)
            except ConfigError as e:
                wrong.append(f"{' '.join(argv)}: {e}")
                continue
            action = PARSER._option_string_actions[flag]
            if (action.nargs == 0) != (count == 0) or getattr(ns, action.dest) is None:
                wrong.append(" ".join(argv))
    assert not wrong, wrong


def _rows(status, accepted=None):
    megatron = {flag for flag, _, _ in megatron_flags()}
    return [f for f in FLAGS if f.status == status and megatron & set(f.names)
            and (accepted is None or f.meaning.endswith("accepted") == accepted)]


def test_a_refused_flag_stops_the_run_naming_itself_and_the_way():
    kinds = {flag: (n, c) for flag, n, c in megatron_flags()}
    unrefused = []
    for f in _rows(REFUSED):
        name = next(n for n in f.names if n in kinds)
        try:
            parse(sample(name, *kinds[name]))
            unrefused.append(name)
        except ConfigError as e:
            line = next((ln for ln in str(e).splitlines() if name in ln.split(": ", 1)[0]), "")
            if not line.endswith(f.meaning) or not str(e).startswith("refused before any process starts"):
                unrefused.append(f"{name}: {e}")
    assert not unrefused, unrefused
    assert len(_rows(REFUSED)) > 400


def test_a_flag_accepted_with_no_effect_changes_nothing():
    base = dataclasses.replace(parse([]), notes=[])
    kinds = {flag: (n, c) for flag, n, c in megatron_flags()}
    changed = []
    for f in _rows(MAPPED, accepted=True):
        for name in (n for n in f.names if n in kinds):
            cfg = parse(sample(name, *kinds[name]))
            if dataclasses.replace(cfg, notes=[]) != base or cfg.zero_config() != base.zero_config():
                changed.append(name)
    assert not changed, changed
    assert len(_rows(MAPPED, accepted=True)) > 30


def test_only_megatrons_default_of_a_flag_megazero_has_one_value_of():
    assert parse(["--softmax-type", "vanilla", "--rerun-mode", "disabled", "--exp-avg-dtype", "fp32",
                  "--cuda-graph-impl", "none", "--exit-signal", "SIGTERM"]) == parse([])
    with pytest.raises(ConfigError) as e:
        parse(["--rerun-mode", "validate_results", "--exp-avg-dtype", "bf16"])
    assert [line.split(":")[0].strip() for line in str(e.value).splitlines()[1:]] == [
        "--exp-avg-dtype bf16", "--rerun-mode validate_results"]


def test_refused_flags_with_one_message_share_its_line():
    with pytest.raises(ConfigError) as e:
        parse(["--profile", "--profile-step-start", "10", "--profile-ranks", "0", "1", "--rl-default-top-k", "-1"])
    lines = sorted(line.strip() for line in str(e.value).splitlines()[1:])
    assert len(lines) == 2 and lines[0].startswith("--profile, --profile-step-start, --profile-ranks: megazero has no")
    assert lines[1].startswith("--rl-default-top-k: reinforcement learning")


@pytest.mark.parametrize("pp, layers, embedding, loss", [(4, 7, True, False), (4, 7, False, True), (4, 6, True, True),
                                                         (2, 5, True, False), (3, 4, True, True)])
def test_account_for_embedding_and_loss_split_the_layers_as_megatron_core(pp, layers, embedding, loss):
    """The layers of each stage, against megatron-core's get_num_layers_to_build for the same config."""
    import torch

    transformer_block = pytest.importorskip("megatron.core.transformer.transformer_block")
    from megatron.core.transformer import TransformerConfig

    from megazero.model.pipeline_split import layers_per_chunk_table

    flags = ["--account-for-embedding-in-pipeline-split"] * embedding + ["--account-for-loss-in-pipeline-split"] * loss
    cfg = parse(["--pp", str(pp), "--num-layers", str(layers)] + flags, pp)
    p = cfg.parallel
    ours = [len(r) for r in layers_per_chunk_table(layers, pp, 1, p.decoder_first_pipeline_num_layers,
                                                   p.decoder_last_pipeline_num_layers)[0]]
    mcore = TransformerConfig(num_layers=layers, hidden_size=64, num_attention_heads=4, pipeline_model_parallel_size=pp,
                              pipeline_dtype=torch.float32, account_for_embedding_in_pipeline_split=embedding,
                              account_for_loss_in_pipeline_split=loss)
    assert ours == [transformer_block.get_num_layers_to_build(mcore, pp_rank=r) for r in range(pp)]


def test_account_for_embedding_refuses_what_megatron_refuses_or_megazero_cannot_split():
    account = ["--pp", "4", "--account-for-embedding-in-pipeline-split"]
    with pytest.raises(ConfigError, match="8 layers \\+ 1 = 9 is not divisible by --pipeline-model-parallel-size 4"):
        parse(account + ["--num-layers", "8"], 4)
    with pytest.raises(ConfigError, match="with --decoder-first/last-pipeline-num-layers"):
        parse(account + ["--num-layers", "7", "--decoder-last-pipeline-num-layers", "1"], 4)
    with pytest.raises(ConfigError, match="with 2 virtual pipeline stages"):
        parse(account + ["--num-layers", "15", "--num-virtual-stages-per-pipeline-rank", "2"], 4)


def test_microbatch_group_size_is_pp():
    interleaved = ["--pp", "2", "--num-virtual-stages-per-pipeline-rank", "2"]
    assert parse(interleaved + ["--microbatch-group-size-per-virtual-pipeline-stage", "2"], 2) == parse(interleaved, 2)
    with pytest.raises(ConfigError, match="groups of pp = 2 .* pass 2"):
        parse(interleaved + ["--microbatch-group-size-per-virtual-pipeline-stage", "4"], 2)


def test_megatron_fsdp_is_zero_with_its_sharding_as_the_stage():
    assert parse(["--use-megatron-fsdp"], 2).parallel.zero_stage == 3
    assert parse(["--use-torch-fsdp2", "--use-distributed-optimizer"], 2).parallel.zero_stage == 3
    for strategy, stage in (("no_shard", 0), ("optim", 1), ("optim_grads", 2), ("optim_grads_params", 3)):
        cfg = parse(["--use-megatron-fsdp", "--data-parallel-sharding-strategy", strategy], 2)
        assert cfg.zero_config() == parse(["--zero-stage", str(stage)], 2).zero_config()
    with pytest.raises(ConfigError, match="is ZeRO stage 3, which contradicts --zero-stage 1"):
        parse(["--use-megatron-fsdp", "--zero-stage", "1"], 2)
    with pytest.raises(ConfigError, match="is Megatron-FSDP's: add --use-megatron-fsdp"):
        parse(["--data-parallel-sharding-strategy", "optim"], 2)


@pytest.mark.parametrize("flags, json_keys", [
    ("--main-grads-dtype bf16", {"data_types": {"grad_accum_dtype": "bf16"}}),
    ("--grad-reduce-in-bf16", {"data_types": {"grad_accum_dtype": "bf16"}}),
    ("--use-megatron-fsdp --megatron-fsdp-main-grads-dtype bf16",
     {"data_types": {"grad_accum_dtype": "bf16"}, "zero_optimization": {"stage": 3}}),
    ("--main-grads-dtype fp32", {"data_types": {"grad_accum_dtype": "fp32"}}),
    ("--megatron-fsdp-grad-comm-dtype bf16", {"communication_data_type": "bf16"}),
])
def test_gradient_dtype_flags_are_the_deepspeed_keys_of_the_same_meaning(tmp_path, flags, json_keys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"bf16": {"enabled": True}, **json_keys}))
    by_flags = parse(["--bf16"] + flags.split(), 2).zero_config()
    assert by_flags == parse(["--bf16", "--deepspeed_config", str(path)], 2).zero_config()
    assert by_flags != parse(["--bf16"], 2).zero_config() or flags == "--main-grads-dtype fp32"


def test_gradient_dtypes_that_disagree_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="--main-grads-dtype bf16, --accumulate-allreduce-grads-in-fp32 fp32 "
                                          "disagree"):
        parse(["--bf16", "--main-grads-dtype", "bf16", "--accumulate-allreduce-grads-in-fp32"])
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"communication_data_type": "fp32"}))
    with pytest.raises(ConfigError, match="gradient reduction dtype: --megatron-fsdp-grad-comm-dtype bf16, "
                                          "communication_data_type \\(DeepSpeed JSON\\) fp32 disagree"):
        parse(["--bf16", "--megatron-fsdp-grad-comm-dtype", "bf16", "--deepspeed_config", str(path)])


def test_data_args_files_stand_for_the_data_path_flags(tmp_path):
    def without_mock(argv):
        return [w for w in TINY if w != "--mock-data"] + argv

    words = tmp_path / "data_args.txt"
    words.write_text("0.3 corpus_a\n0.7 corpus_b\n")
    per_split = tmp_path / "per_split.json"
    per_split.write_text(json.dumps({"train": "1 corpus_a 1 corpus_b", "valid": ["corpus_c"], "test": []}))
    by_file = parse_args(without_mock(["--data-args-path", str(words)]), 1, check_files=False)
    assert by_file == parse_args(without_mock(["--data-path", "0.3", "corpus_a", "0.7", "corpus_b"]), 1,
                                 check_files=False)
    by_file = parse_args(without_mock(["--per-split-data-args-path", str(per_split)]), 1, check_files=False)
    assert by_file == parse_args(without_mock(["--train-data-path", "1", "corpus_a", "1", "corpus_b",
                                               "--valid-data-path", "corpus_c"]), 1, check_files=False)
    with pytest.raises(ConfigError, match="stands for --data-path: give one of them"):
        parse_args(without_mock(["--data-args-path", str(words), "--data-path", "x"]), 1, check_files=False)
    with pytest.raises(ConfigError, match="no such file"):
        parse_args(without_mock(["--data-args-path", str(tmp_path / "none")]), 1)


def test_exit_on_missing_checkpoint(tmp_path):
    load = ["--load", str(tmp_path / "typo")]
    assert parse_args(TINY + load, 1).checkpoint.load == str(tmp_path / "typo")  # Megatron's default: from scratch
    with pytest.raises(ConfigError, match="--exit-on-missing-checkpoint: --load .*typo holds no checkpoint"):
        parse_args(TINY + load + ["--exit-on-missing-checkpoint"], 1)


def test_a_2025_deepseek_v3_megatron_fsdp_script_is_answered_flag_by_flag():
    """Megatron-LM's DeepSeek-V3 Megatron-FSDP script: one message lists what megazero refuses, each with its
    way; with those flags dropped the rest parses (the FSDP sharding as ZeRO-3, its bf16 gradients)."""
    argv = script_args("sbatch_mfsdp_deepseek_v3")
    with pytest.raises(ConfigError) as e:
        parse_args(argv, 8, check_files=False)
    message = str(e.value)
    assert "unknown flag" not in message
    refused = {"--transformer-impl", "--use-nccl-ub", "--moe-token-dispatcher-type", "--moe-flex-dispatcher-backend",
               "--moe-router-force-load-balancing", "--calculate-per-token-loss", "--ckpt-format", "--profile",
               "--profile-step-start", "--profile-step-end", "--profile-ranks"}
    named = [w.rstrip(",") for line in message.splitlines()[1:] for w in line.split(": ")[0].split()
             if w.startswith("--")]  # the flags each line is about, before its message
    assert sorted(named) == sorted(refused)
    kept, skip = [], False
    for word in argv:
        skip = word in refused | {"--recompute-modules"} if word.startswith("--") else skip
        kept += [] if skip else [word]
    cfg = parse_args(kept + ["--vocab-size", "129280"], 8, check_files=False)  # the HF tokenizer is not read here
    z = cfg.zero_config()
    assert (cfg.parallel.zero_stage, cfg.parallel.ep, cfg.model.num_layers, cfg.model.mtp_num_layers) == (3, 8, 61, 1)
    assert str(z.grad_dtype) == str(z.reduce_dtype) == "torch.bfloat16"
