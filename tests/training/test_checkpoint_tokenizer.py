"""Checkpoints from the Megatron world are refused by name at --load; a megazero checkpoint records
its tokenizer by content, and tools/convert_to_hf.py exports it with the right eos id."""

import importlib.util
import json
import os
from pathlib import Path

import pytest

from tests.distributed import run_distributed

ROOT = Path(__file__).resolve().parents[2]

EOT = 3  # <|endoftext|> in the tiny vocabulary below; GPT-2's default eos would be 50256


@pytest.fixture
def gpt2_files(tmp_path):
    vocab, merges = tmp_path / "vocab.json", tmp_path / "merges.txt"
    vocab.write_text(json.dumps({"a": 0, "b": 1, "ab": 2, "<|endoftext|>": EOT}))
    merges.write_text("#version: 0.2\na b\n")
    return str(vocab), str(merges)


def load_tool(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def argv(*extra):
    return ["--tp", "2", "--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2",
            "--seq-length", "8", "--max-position-embeddings", "8", "--micro-batch-size", "2", "--train-iters", "2",
            "--lr", "1e-3", "--mock-data", "--log-interval", "1", "--eval-iters", "0", *extra]


def _pretrain(args, world):
    from megazero.config import parse_args
    from megazero.utils.phase_agreement import RunAborted
    from megazero.training.trainer import pretrain

    try:
        return pretrain(parse_args(args, world)).iteration
    except RunAborted as e:
        return e.user, e.message


def test_megatron_lm_legacy_checkpoint_is_refused_by_name(tmp_path):
    load = tmp_path / "megatron_ckpt"
    rank_dir = load / "iter_0000500" / "mp_rank_00"
    rank_dir.mkdir(parents=True)
    (rank_dir / "model_optim_rng.pt").write_bytes(b"not read")
    (load / "latest_checkpointed_iteration.txt").write_text("500")
    results = run_distributed(2, _pretrain, argv("--load", str(load), "--vocab-size", "64"), 2)
    for user, message in results:  # every rank stops, with the message, as a user error
        assert user and f"{load} is a Megatron-LM checkpoint (legacy mp_rank_XX format, tp=1, pp=1)" in message
        assert "tools/convert_from_megatron.py" in message


def test_checkpoint_records_the_tokenizer_and_convert_to_hf_exports_it(tmp_path, gpt2_files):
    vocab, merges = gpt2_files
    save = tmp_path / "ckpt"
    args = argv("--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges,
                "--save", str(save), "--save-interval", "2")
    assert run_distributed(2, _pretrain, args, 2) == [2, 2]
    it = save / "iter_0000002"
    recorded = sorted(os.listdir(it / "tokenizer"))
    assert recorded == ["megazero_tokenizer.json", "merges.txt", "vocab.json"]
    assert (it / "tokenizer" / "vocab.json").read_bytes() == open(vocab, "rb").read()  # by content
    manifest = json.load(open(it / "manifest.json"))["files"]
    assert {f"tokenizer/{n}" for n in recorded} <= set(manifest)
    assert not any(name.endswith(".partial") for name in os.listdir(save))

    from megazero.config import ConfigError, parse_args

    resume = argv("--load", str(save)) + ["--data-path", "corpus"]  # file data: the tokenizer is needed
    resume.remove("--mock-data")
    assert parse_args(resume, 2, check_files=False).data.vocab_file == str(it / "tokenizer" / "vocab.json")
    with pytest.raises(ConfigError, match="GPT2BPETokenizer .* needs --vocab-file"):  # the default, not the recorded
        parse_args(resume + ["--no-use-tokenizer-model-from-checkpoint-args"], 2, check_files=False)

    out = tmp_path / "hf"
    assert load_tool("convert_to_hf").main(["--input", str(save), "--output", str(out)]) == 0
    hf_config = json.load(open(out / "config.json"))
    assert hf_config["eos_token_id"] == EOT and hf_config["bos_token_id"] == EOT
    assert json.load(open(out / "generation_config.json"))["eos_token_id"] == EOT
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    assert tok.eos_token_id == EOT and tok("ab")["input_ids"] == [2]
