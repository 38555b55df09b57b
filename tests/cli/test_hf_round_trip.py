"""A Hugging Face model through megazero's tools and back, with no shape or tokenizer flags anywhere:
tools/convert_from_hf.py (the weights, the config and the tokenizer), tools/generate.py --load at tp 1
and 2 (the greedy tokens of transformers' own generate), pretrain_gpt.py fine-tuning from it (1 process, tp 2 (ep 2
for the mixture) and pp 2: the same losses), tools/convert_to_hf.py (the original weights bit for bit, the tokenizer with
them; the fine-tuned model generating as megazero does). The model is a random GPT-2, Llama or Mixtral
built with transformers and a word-level tokenizer built with ``tokenizers``: nothing is downloaded."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from safetensors.torch import load_file  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402

from megazero.cli import convert_from_hf, convert_to_hf, generate  # noqa: E402
from megazero.config.arguments import ConfigError, parse_args  # noqa: E402
from tests.launch import in_pool  # noqa: E402
from tests.model.test_hf import _random_hf as random_dense  # noqa: E402
from tests.model.test_hf_moe import _random_hf as random_moe  # noqa: E402

VOCAB = 90  # the random models' vocabulary (tests/model/test_hf*.py)
EOT = 0  # <|endoftext|>
PROMPT_IDS = [5, 7, 9, 11]
NEW = 8
# What a fine-tune gives beyond the checkpoint; the dropout comes from it (0 for Llama and Mixtral: torch's dropout
# streams follow the layout, so the layouts' losses agree only without it). GPT-2's is 0.1: FINETUNE sets 0.
TUNE = ["--mock-data", "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-3",
        "--seq-length", "16", "--log-interval", "1", "--eval-iters", "0"]
FINETUNE = TUNE + ["--hidden-dropout", "0", "--attention-dropout", "0"]


def word(i: int) -> str:
    return "<|endoftext|>" if i == EOT else f"w{i}"


def save_tokenizer(hf_dir) -> None:
    """A word-level tokenizer over the model's whole vocabulary: "w5 w7" <-> [5, 7]."""
    tok = Tokenizer(models.WordLevel({word(i): i for i in range(VOCAB)}, unk_token=word(EOT)))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(os.path.join(hf_dir, "tokenizer.json"))
    with open(os.path.join(hf_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": word(EOT), "tokenizer_class": "PreTrainedTokenizerFast"}, f)


def random_hf(kind: str, hf_dir, with_tokenizer: bool = True):
    model = random_dense(kind, hf_dir) if kind in ("gpt2", "llama") else random_moe(kind, hf_dir)
    if with_tokenizer:
        save_tokenizer(str(hf_dir))
    return model


def hf_greedy(model, ids: list[int], new: int) -> list[int]:
    """transformers' greedy generate, never stopping early (its config's eos is not ours)."""
    model.generation_config.eos_token_id = None
    out = model.generate(torch.tensor([ids]), max_new_tokens=new, do_sample=False, pad_token_id=EOT)
    return out[0].tolist()


def generated_ids(capsys, argv: list[str]) -> list[int]:
    capsys.readouterr()
    assert generate.main(argv + ["--temperature", "0", "--max-new-tokens", str(NEW)]) == 0
    text = capsys.readouterr().out.strip()
    return [EOT if w == word(EOT) else int(w.removeprefix("w")) for w in text.split()]


def assert_same_greedy(ours: list[int], theirs: list[int]) -> None:
    """Ours stops after the end-of-document token; up to there, the same tokens."""
    assert ours == theirs[:len(ours)], (ours, theirs)
    assert len(ours) == len(theirs) or ours[-1] == EOT


def losses(world: int, argv: list[str], metrics, tune: list[str] = FINETUNE) -> dict[int, float]:
    run = in_pool(world, tune + argv + ["--metrics-file", str(metrics)])
    assert run.returncode == 0, run.output[-3000:]
    return {m["iteration"]: m["lm_loss"] for m in map(json.loads, open(metrics)) if "lm_loss" in m}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["gpt2", "llama", "mixtral"])
def test_hf_model_converts_generates_finetunes_and_exports_back(kind, tmp_path, capsys):
    hf = random_hf(kind, tmp_path / "hf")
    mz = tmp_path / "mz"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(mz)]) == 0
    assert sorted(os.listdir(mz / "tokenizer")) == ["megazero_tokenizer.json", "tokenizer.json", "tokenizer_config.json"]

    prompt = " ".join(map(word, PROMPT_IDS))
    expected = hf_greedy(hf, PROMPT_IDS, NEW)
    ours = generated_ids(capsys, ["--load", str(mz), "--prompt", prompt])
    assert_same_greedy(ours, expected)
    at_tp2 = in_pool(2, ["--load", mz, "--tp", "2", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", NEW],
                     script="tools/generate.py")  # each rank reads its shard of the full weights
    assert at_tp2.returncode == 0, at_tp2.stderr[-3000:]
    assert at_tp2.stdout.split() == list(map(word, ours))

    # fine-tuning: the shape, the tokenizer and the dropout (but GPT-2's) from the checkpoint, at three layouts
    tune = FINETUNE if kind == "gpt2" else TUNE
    one = losses(1, ["--pretrained-checkpoint", str(mz), "--save", str(tmp_path / "ft"), "--save-interval", "3"],
                 tmp_path / "one.jsonl", tune)
    # a mixture splits its experts over expert parallelism, the checkpoint's experts (at tp 2 its gradients are
    # not yet tp 1's)
    split = ["--tp", "2"] if kind in ("gpt2", "llama") else ["--expert-model-parallel-size", "2"]
    two = losses(2, ["--load", str(mz), "--finetune"] + split, tmp_path / "two.jsonl", tune)
    pp2 = losses(2, ["--pretrained-checkpoint", str(mz), "--pp", "2"], tmp_path / "pp2.jsonl", tune)
    assert sorted(one) == sorted(two) == sorted(pp2) == [1, 2, 3]
    for i in one:
        assert two[i] == pytest.approx(one[i], abs=2e-5) and pp2[i] == pytest.approx(one[i], abs=2e-5), (one, two, pp2)
    ft_tokenizer = tmp_path / "ft" / "iter_0000003" / "tokenizer"
    assert (ft_tokenizer / "tokenizer.json").read_bytes() == (tmp_path / "hf" / "tokenizer.json").read_bytes()

    # back to Hugging Face: the converted weights bit for bit, and the tokenizer
    assert convert_to_hf.main(["--load", str(mz), "--output", str(tmp_path / "back")]) == 0
    before, after = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    if kind == "gpt2":
        before.pop("lm_head.weight", None)  # the tied copy
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))
    assert tok(prompt)["input_ids"] == PROMPT_IDS and tok.eos_token_id == EOT

    # the fine-tuned model, exported: transformers generates what tools/generate.py does from the checkpoint
    assert convert_to_hf.main(["--load", str(tmp_path / "ft"), "--output", str(tmp_path / "ft_hf")]) == 0
    tuned = load_file(str(tmp_path / "ft_hf" / "model.safetensors"))
    assert tuned.keys() == after.keys() and not all(torch.equal(tuned[k], after[k]) for k in after)
    tuned_hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ft_hf")).eval()
    if kind != "gpt2":  # the fine-tune trained without dropout, as the original, and its export says so
        assert tuned_hf.config.attention_dropout == hf.config.attention_dropout == 0.0
    assert_same_greedy(generated_ids(capsys, ["--load", str(tmp_path / "ft"), "--prompt", prompt]),
                       hf_greedy(tuned_hf, PROMPT_IDS, NEW))


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A random Llama (8 heads, 2 key/value groups, untied) converted with its tokenizer."""
    d = tmp_path_factory.mktemp("llama")
    hf = random_hf("llama", d / "hf")
    assert convert_from_hf.main(["--input", str(d / "hf"), "--output", str(d / "mz")]) == 0
    return hf, d / "mz"


def test_the_model_comes_from_the_checkpoint_without_shape_flags(converted):
    _, mz = converted
    saved = json.load(open(mz / "config.json"))
    for start in (["--pretrained-checkpoint", str(mz)], ["--load", str(mz), "--finetune"],
                  ["--load", str(mz), "--use-checkpoint-args"]):
        cfg = parse_args(FINETUNE + start, 1)
        m = cfg.model
        assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.vocab_size, m.ffn_size) == (
            saved["num_layers"], saved["hidden_size"], saved["num_attention_heads"], saved["num_query_groups"],
            saved["vocab_size"], saved["ffn_hidden_size"])
        assert (m.normalization, m.activation, m.position_embedding_type, m.tie_embeddings) == (
            "rmsnorm", "swiglu", "rope", False)
        assert m.seq_length == 16  # given: the sequence length is the run's
        assert cfg.checkpoint.pretrained == str(mz)  # --load of full weights starts from them
        assert cfg.data.tokenizer_type == "HuggingFaceTokenizer" and cfg.data.tokenizer_model == str(mz / "tokenizer")


@pytest.mark.parametrize("flags, given, field, value", [
    (["--num-attention-heads", "4"], "--num-attention-heads 4", "num_attention_heads", "8"),
    (["--num-query-groups", "8"], "--num-query-groups 8", "num_query_groups", "2"),
    (["--normalization", "LayerNorm"], "--normalization layernorm", "normalization", "'?rmsnorm'?"),
    (["--squared-relu"], "--squared-relu", "activation", "'?swiglu'?"),
    (["--vocab-size", "100", "--tokenizer-type", "HuggingFaceTokenizer"], "--vocab-size 100", "vocab_size", "90"),
])
def test_a_model_flag_that_disagrees_with_the_checkpoint_is_refused(converted, flags, given, field, value):
    _, mz = converted
    extra = ["--tokenizer-model", str(mz / "tokenizer")] if "--tokenizer-type" in flags else []
    with pytest.raises(ConfigError) as e:
        parse_args(FINETUNE + ["--pretrained-checkpoint", str(mz), "--use-checkpoint-args"] + flags + extra, 1)
    message = str(e.value)
    assert message.startswith(f"{given} disagrees with the checkpoint") and "\n" not in message
    # the checkpoint's value, by field or by flag name, and where it comes from
    flag_name = "--" + field.replace("_", "-")
    assert re.search(rf"({field}=|{flag_name} ){value}", message), message
    assert str(mz / "config.json") in message
    agreeing = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--swiglu",
                "--normalization", "RMSNorm", "--num-query-groups", "2"]
    assert parse_args(FINETUNE + ["--pretrained-checkpoint", str(mz), "--use-checkpoint-args"] + agreeing,
                      1).model.ffn_size == 96


SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8", "--num-query-groups", "2",
         "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights"]  # the converted Llama's, as a user types them


@pytest.mark.parametrize("shape", [[], SHAPE], ids=["no_shape_flags", "shape_flags"])
def test_a_fine_tune_takes_what_no_flag_sets_from_the_checkpoint(converted, shape):
    """With or without the model's shape flags: the dropout, the norms' epsilon and the initialisation the
    export records are the checkpoint's (transformers' own values), not Megatron's defaults; a dropout flag
    sets another, and the start-up notes name both."""
    from megazero.model.interop.hf import hf_config_dict

    hf, mz = converted
    cfg = parse_args(TUNE + ["--pretrained-checkpoint", str(mz)] + shape, 1)
    m = cfg.model
    assert (m.hidden_dropout, m.attention_dropout) == (0.0, hf.config.attention_dropout)
    assert (m.layernorm_epsilon, m.init_method_std) == (hf.config.rms_norm_eps, hf.config.initializer_range)
    exported = hf_config_dict(m)
    assert (exported["attention_dropout"], exported["rms_norm_eps"], exported["initializer_range"]) == (
        hf.config.attention_dropout, hf.config.rms_norm_eps, hf.config.initializer_range)
    assert not any("cannot export" in n for n in cfg.notes)
    tuned = parse_args(TUNE + ["--pretrained-checkpoint", str(mz), "--hidden-dropout", "0.1"] + shape, 1)
    assert (tuned.model.hidden_dropout, tuned.model.attention_dropout) == (0.1, 0.0)
    said = [n for n in tuned.notes if n.startswith("--hidden-dropout 0.1 in place of the checkpoint's")]
    assert len(said) == 1 and "hidden_dropout=0.0" in said[0] and str(mz / "config.json") in said[0], tuned.notes


def test_use_checkpoint_args_needs_a_checkpoint(tmp_path):
    with pytest.raises(ConfigError, match="--use-checkpoint-args needs --load or --pretrained-checkpoint"):
        parse_args(FINETUNE + ["--use-checkpoint-args"], 1)
    with pytest.raises(ConfigError, match="holds no checkpoint"):
        parse_args(FINETUNE + ["--use-checkpoint-args", "--load", str(tmp_path)], 1)
    with pytest.raises(ConfigError, match="--load/--pretrained-checkpoint with a checkpoint to take the model from"):
        parse_args(FINETUNE + ["--vocab-size", "64", "--load", str(tmp_path)], 1)  # no checkpoint there yet
    with pytest.raises(ConfigError, match="--pretrained-checkpoint .* has no model_full.safetensors"):
        parse_args(FINETUNE + ["--pretrained-checkpoint", str(tmp_path / "absent")], 1)


def test_generate_tokenizers(converted, tmp_path, capsys):
    """The recorded tokenizer by default; --tokenizer-type overrides it; without one, ids as text."""
    hf, mz = converted
    expected = hf_greedy(hf, PROMPT_IDS, NEW)
    ids_text = " ".join(map(str, PROMPT_IDS))
    capsys.readouterr()
    assert generate.main(["--load", str(mz), "--prompt", ids_text, "--temperature", "0", "--max-new-tokens", str(NEW),
                          "--tokenizer-type", "NullTokenizer", "--vocab-size", str(VOCAB - 1)]) == 0
    ours = [int(w) for w in capsys.readouterr().out.split()]
    assert ours == expected[:len(ours)] and (len(ours) == len(expected) or ours[-1] == VOCAB - 1)

    random_hf("llama", tmp_path / "bare", with_tokenizer=False)
    assert convert_from_hf.main(["--input", str(tmp_path / "bare"), "--output", str(tmp_path / "mz")]) == 0
    assert not (tmp_path / "mz" / "tokenizer").exists()
    assert generate.main(["--load", str(tmp_path / "mz"), "--prompt", ids_text, "--temperature", "0",
                          "--max-new-tokens", str(NEW)]) == 0
    out = capsys.readouterr()
    ours = [int(w) for w in out.out.split()]
    assert ours == expected[:len(ours)] and "token ids" in out.err  # the same weights: the same tokens


def test_a_tokenizer_larger_than_the_model_is_not_carried(tmp_path, capsys):
    random_hf("gpt2", tmp_path / "hf", with_tokenizer=False)
    tok = Tokenizer(models.WordLevel({word(i): i for i in range(200)}, unk_token=word(EOT)))
    tok.save(str(tmp_path / "hf" / "tokenizer.json"))
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz"),
                                 "--override", "make_vocab_size_divisible_by=32"]) == 1
    assert "has 200 tokens, more than the model's 96 embedding rows" in capsys.readouterr().err
    assert not (tmp_path / "mz" / "tokenizer").exists()


def test_a_megatron_import_generates_and_trains_from_the_args_it_saved(tmp_path, capsys):
    """tools/convert_from_megatron.py writes the same full checkpoint: its config.json comes from the Megatron
    run's args, so generate.py and pretrain_gpt.py read the model from it too."""
    from megazero.cli import convert_from_megatron
    from tests.model import test_megatron_import as megatron

    args = megatron._args("llama", 2, 2)
    full, groups = megatron._full_megatron_weights(args)
    (tmp_path / "megatron").mkdir()
    megatron.write_megatron_lm(tmp_path / "megatron", args, full, groups)
    mz = tmp_path / "mz"
    assert convert_from_megatron.main(["--input", str(tmp_path / "megatron"), "--output", str(mz)]) == 0
    expected = [3, 1, 4]
    for _ in range(megatron.SEQ - len(expected)):  # Megatron's own forward, greedily
        logits = megatron.reference_logits(args, full, groups, torch.tensor([expected]))
        expected.append(int(logits[0, -1].argmax()))
    capsys.readouterr()
    assert generate.main(["--load", str(mz), "--prompt", "3 1 4", "--temperature", "0",
                          "--max-new-tokens", str(megatron.SEQ - 3)]) == 0
    ours = [int(w) for w in capsys.readouterr().out.split()]
    eod = megatron.VOCAB - 1  # NullTokenizer over the model's vocabulary
    assert ours == expected[:len(ours)] and (len(ours) == len(expected) or ours[-1] == eod), (ours, expected)
    m = parse_args(FINETUNE + ["--pretrained-checkpoint", str(mz)], 1).model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.query_groups, m.ffn_size, m.activation) == (
        args.num_layers, args.hidden_size, args.num_attention_heads, args.num_query_groups, args.ffn_hidden_size,
        "swiglu")
