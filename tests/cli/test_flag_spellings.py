"""One spelling per concept across pretrain_gpt.py, the tools and the benchmarks: the canonical flag comes first
(it is the one --help shows first) and every older spelling parses to the same namespace. (The planning tools'
earlier spellings of pretrain_gpt.py's flags: tests/cli/test_planning_flags.py.)"""

from __future__ import annotations

import argparse

import pytest

from tests.cli.programs import PROGRAMS, parser, required_words, sample_value

MEMORY_BASE = ["--model-preset", "13b", "--world-size", "1"]
PREPROCESS_BASE = ["--input", "in.jsonl", "--tokenizer-type", "NullTokenizer", "--output-prefix", "out"]
TOKENIZER_BASE = ["--input", "in.jsonl", "--vocab-size", "300", "--output-prefix", "tok"]

# (program, other flags, canonical spelling, an older spelling)
SPELLINGS = [
    ("estimate_memory", MEMORY_BASE, ["--device-memory-gb", "40"], ["--gpu-memory-gb", "40"]),
    ("rehearse", ["--world-size", "8"], ["--device-memory-gb", "40"], ["--gpu-memory-gb", "40"]),
    ("estimate_memory", MEMORY_BASE, ["--tensor-model-parallel-size", "4"], ["--tp", "4"]),
    ("estimate_memory", MEMORY_BASE, ["--pipeline-model-parallel-size", "2"], ["--pp", "2"]),
    ("estimate_memory", MEMORY_BASE, ["--context-parallel-size", "2"], ["--cp", "2"]),
    ("estimate_memory", MEMORY_BASE, ["--expert-model-parallel-size", "2"], ["--ep", "2"]),
    ("rehearse", ["--world-size", "8"], ["--tensor-model-parallel-size", "2"], ["--tp", "2"]),
    ("preprocess_data", PREPROCESS_BASE, ["--json-keys", "body"], ["--json-key", "body"]),
    ("preprocess_data", PREPROCESS_BASE, ["--json-keys", "text", "title"], ["--json-key", "text", "title"]),
    ("train_tokenizer", TOKENIZER_BASE, ["--json-keys", "body"], ["--json-key", "body"]),
    ("train_tokenizer", TOKENIZER_BASE, ["--json-keys", "body", "title"], ["--json-key", "body", "title"]),
    ("convert_to_hf", ["--output", "hf"], ["--load", "ckpt"], ["--input", "ckpt"]),
    ("generate", ["--load", "ckpt"], ["--tensor-model-parallel-size", "2"], ["--tp", "2"]),
    ("generate", ["--load", "ckpt"], ["--ckpt-step", "5"], ["--iteration", "5"]),
    ("generate", ["--load", "ckpt"], ["--prompt", "ROMEO:"], ["--generate-prompt", "ROMEO:"]),
    ("generate", ["--load", "ckpt"], ["--max-new-tokens", "8"], ["--generate-tokens", "8"]),
    ("pretrain_gpt", [], ["--tensor-model-parallel-size", "2"], ["--tp", "2"]),
    ("pretrain_gpt", [], ["--pipeline-model-parallel-size", "2"], ["--pp", "2"]),
]


def _action(p: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in p._actions if flag in a.option_strings)


@pytest.mark.parametrize("name, base, canonical, alias", SPELLINGS,
                         ids=[f"{s[0]}:{s[3][0]}" for s in SPELLINGS])
def test_canonical_and_alias_parse_alike(name, base, canonical, alias):
    p = parser(name)
    action = _action(p, alias[0])
    assert action.option_strings[0] == canonical[0]
    got = p.parse_args(base + canonical)
    assert got == p.parse_args(base + alias)
    assert getattr(got, action.dest) != p.get_default(action.dest)  # the flag was taken


def test_a_megazero_checkpoint_to_read_is_load_everywhere():
    """Every program that reads a megazero checkpoint takes it as --load (convert_to_hf also as --input);
    foreign inputs (HF, Megatron, text, datasets) stay --input."""
    for name in ("pretrain_gpt", "generate", "convert_to_hf"):
        assert "--load" in parser(name)._option_string_actions, name
    for name in ("convert_from_hf", "convert_from_megatron", "preprocess_data", "train_tokenizer", "merge_datasets"):
        assert "--load" not in parser(name)._option_string_actions and "--input" in parser(name)._option_string_actions


@pytest.mark.parametrize("name", PROGRAMS)
def test_every_alias_of_every_program_parses_like_its_canonical_flag(name):
    p = parser(name)
    base = required_words(p)
    checked = 0
    for action in p._actions:
        if len(action.option_strings) < 2 or isinstance(action, argparse._HelpAction):
            continue
        value = sample_value(action)
        expected = p.parse_args(base + [action.option_strings[0], *value])
        for alias in action.option_strings[1:]:
            assert p.parse_args(base + [alias, *value]) == expected, (name, alias)
            checked += 1
    if name in ("pretrain_gpt", "estimate_memory", "generate", "convert_to_hf", "rehearse", "preprocess_data",
                "train_tokenizer"):
        assert checked, f"{name}: no alias found"


@pytest.mark.parametrize("module, base, canonical, alias", [
    ("bench_zero", [], ["--num-attention-heads", "4"], ["--num-heads", "4"]),
    ("bench_zero", [], ["--micro-batch-size", "2"], ["--micro-batch", "2"]),
    ("bench_zero", [], ["--world-size", "2"], ["--nproc", "2"]),
    ("zero_baselines", ["--system", "megazero", "--json", "r.json"], ["--num-attention-heads", "4"],
     ["--num-heads", "4"]),
    ("zero_baselines", ["--system", "megazero", "--json", "r.json"], ["--micro-batch-size", "2"],
     ["--micro-batch", "2"]),
    ("zero_baselines", ["--system", "megazero"], ["--json", "r.json"], ["--out", "r.json"]),
])
def test_benchmark_spellings(module, base, canonical, alias):
    import importlib

    parse = importlib.import_module(f"benchmarks.{module}").parse_args
    assert parse(base + canonical) == parse(base + alias)
