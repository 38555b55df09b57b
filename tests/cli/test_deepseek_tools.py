"""A Hugging Face DeepSeek-V3 through megazero's tools by their command lines: tools/convert_from_hf.py (streamed
one layer at a time), tools/generate.py on its output (transformers' greedy tokens, with the model's tokenizer
at tp 1 and 2 and, without one, token ids as text), tools/convert_to_hf.py (the original tensors bit for bit, DeepSeek's
multi-token prediction layer among them); an HF config megazero cannot represent is refused in one line."""

from __future__ import annotations

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from safetensors.torch import load_file  # noqa: E402

from megazero.cli import convert_from_hf, convert_to_hf, generate  # noqa: E402
from megazero.model.interop.hf import import_from_hf  # noqa: E402
from tests.cli.test_hf_round_trip import (NEW, PROMPT_IDS, VOCAB, assert_same_greedy, generated_ids,  # noqa: E402
                                          hf_greedy, save_tokenizer, word)
from tests.launch import in_pool  # noqa: E402
from tests.model.test_hf_deepseek import add_mtp_layer, random_hf  # noqa: E402


def same_tensors(a: str, b: str) -> None:
    before, after = load_file(a), load_file(b)
    assert before.keys() == after.keys()
    for k in before:
        assert torch.equal(before[k], after[k]), k


@pytest.mark.parametrize("q_lora_rank", [24, None], ids=["q_lora", "no_q_lora"])
def test_deepseek_converts_generates_and_exports_back(q_lora_rank, tmp_path, capsys):
    hf = random_hf(tmp_path / "hf", q_lora_rank=q_lora_rank)
    save_tokenizer(str(tmp_path / "hf"))
    mz = tmp_path / "mz"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(mz)]) == 0
    saved = json.load(open(mz / "config.json"))
    assert saved["multi_latent_attention"] and saved["q_lora_rank"] == q_lora_rank and saved["mtp_num_layers"] == 0

    prompt = " ".join(map(word, PROMPT_IDS))
    ours = generated_ids(capsys, ["--load", str(mz), "--prompt", prompt])
    assert_same_greedy(ours, hf_greedy(hf, PROMPT_IDS, NEW))
    if q_lora_rank is not None:  # each of 2 ranks reads its heads' shard of the full weights
        at_tp2 = in_pool(2, ["--load", mz, "--tp", "2", "--prompt", prompt, "--temperature", "0", "--max-new-tokens",
                             NEW], script="tools/generate.py")
        assert at_tp2.returncode == 0, at_tp2.stderr[-3000:]
        assert at_tp2.stdout.split() == list(map(word, ours))

    assert convert_to_hf.main(["--load", str(mz), "--output", str(tmp_path / "back")]) == 0
    same_tensors(str(tmp_path / "hf" / "model.safetensors"), str(tmp_path / "back" / "model.safetensors"))
    again = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back")).eval()
    assert type(again).__name__ == "DeepseekV3ForCausalLM"
    assert transformers.AutoTokenizer.from_pretrained(str(tmp_path / "back"))(prompt)["input_ids"] == PROMPT_IDS
    assert hf_greedy(again, PROMPT_IDS, NEW) == hf_greedy(hf, PROMPT_IDS, NEW)


def test_without_a_tokenizer_generate_reads_and_writes_ids(tmp_path, capsys):
    hf = random_hf(tmp_path / "hf")
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz")]) == 0
    assert not (tmp_path / "mz" / "tokenizer").exists()
    capsys.readouterr()
    assert generate.main(["--load", str(tmp_path / "mz"), "--prompt", " ".join(map(str, PROMPT_IDS)),
                          "--temperature", "0", "--max-new-tokens", str(NEW)]) == 0
    out = capsys.readouterr()
    ours, expected = [int(w) for w in out.out.split()], hf_greedy(hf, PROMPT_IDS, NEW)
    assert ours == expected[:len(ours)] and (len(ours) == len(expected) or ours[-1] == VOCAB - 1), (ours, expected)
    assert "token ids" in out.err


@pytest.mark.parametrize("rope_interleave", [True, False], ids=["interleaved", "rotate_half"])
def test_multi_token_prediction_layers_stream_both_ways(rope_interleave, tmp_path, capsys):
    hf = random_hf(tmp_path / "hf", rope_interleave=rope_interleave)
    add_mtp_layer(tmp_path / "hf", hf)
    mz = tmp_path / "mz"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(mz)]) == 0
    streamed = load_file(str(mz / "model_full.safetensors"))
    _, whole = import_from_hf(str(tmp_path / "hf"))  # the same conversion, all tensors at once
    assert streamed.keys() == whole.keys() and any(k.startswith("mtp.layers.0.transformer_layer.") for k in whole)
    assert all(torch.equal(streamed[k], whole[k]) for k in whole)
    capsys.readouterr()  # the prediction modules are a training-time output: generation is the model's own
    assert generate.main(["--load", str(mz), "--prompt", " ".join(map(str, PROMPT_IDS)), "--temperature", "0",
                          "--max-new-tokens", str(NEW)]) == 0
    ours, expected = [int(w) for w in capsys.readouterr().out.split()], hf_greedy(hf, PROMPT_IDS, NEW)
    assert ours == expected[:len(ours)] and (len(ours) == len(expected) or ours[-1] == VOCAB - 1), (ours, expected)
    if rope_interleave:  # (a rotate-half checkpoint exports interleaved)
        assert convert_to_hf.main(["--load", str(mz), "--output", str(tmp_path / "back")]) == 0
        same_tensors(str(tmp_path / "hf" / "model.safetensors"), str(tmp_path / "back" / "model.safetensors"))


def test_a_config_megazero_cannot_represent_is_refused_in_one_line(tmp_path, capsys):
    random_hf(tmp_path / "hf")
    path = tmp_path / "hf" / "config.json"
    config = json.load(open(path))
    json.dump({**config, "norm_topk_prob": False}, open(path, "w"))
    capsys.readouterr()
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz")]) == 1
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and "norm_topk_prob=False with num_experts_per_tok=2" in errors[0], errors
    assert not os.path.exists(tmp_path / "mz" / "model_full.safetensors")


def test_a_trained_checkpoint_exports_with_its_expert_biases(tmp_path):
    """pretrain_gpt.py trains a DeepSeek-V3-shaped model (expert biases moving every step) at pp 2 x ep 2 and
    saves; tools/convert_to_hf.py exports that training checkpoint: the routers' biases become
    e_score_correction_bias, and transformers' logits equal the checkpoint's model's (tools/generate.py's
    loader)."""
    import types

    from megazero.cli.generate import load_tp_shard
    from megazero.training.checkpoint_reader import open_checkpoint
    from tests.training.test_deepseek_training import DEEPSEEK
    from tests.training.test_layout_invariance import flags, launch, write_corpus

    data = write_corpus(tmp_path)
    ckpt = tmp_path / "ckpt"
    launch(4, flags(data, *DEEPSEEK, "--norm-epsilon", "1e-6", "--pipeline-model-parallel-size", "2",
                    "--expert-model-parallel-size", "2", "--save", str(ckpt), "--save-interval", "3", iters=3),
           tmp_path, "train")
    assert convert_to_hf.main(["--load", str(ckpt), "--output", str(tmp_path / "hf")]) == 0
    exported = load_file(str(tmp_path / "hf" / "model.safetensors"))
    biases = [v for k, v in exported.items() if k.endswith("e_score_correction_bias")]
    # three mixtures and the MTP layer's; each bias moved +-rate per step: after 3 steps none is zero
    assert len(biases) == 4 and all((b.abs() > 0).all() for b in biases)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()

    config, reader, _ = open_checkpoint(str(ckpt))
    model = load_tp_shard(config, reader, types.SimpleNamespace(tp_rank=0, tp_size=1))  # one process, whole
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours = model(ids)[..., :config.vocab_size]
        theirs = hf(ids).logits
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)
