"""A Qwen3-Next and a multimodal Qwen3.5 through the user's commands: tools/convert_from_hf.py (streamed layer by
layer), tools/generate.py (transformers' greedy tokens), pretrain_gpt.py fine-tuning from the import in one process,
at tp 2 and at cp 2 (the same losses: Gated DeltaNet split by key heads, its state carried across the context
chunks, 80 tokens over two chunks of the delta rule), tools/convert_to_hf.py back bit for bit, and the fine-tuned
checkpoint exported to a model transformers runs greedily as tools/generate.py does."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from safetensors.torch import load_file  # noqa: E402

from megazero.cli import convert_from_hf, convert_to_hf, generate  # noqa: E402
from megazero.model.state_dict import load_full  # noqa: E402
from tests.cli.test_hf_round_trip import TUNE, losses  # noqa: E402
from tests.model.test_hf_qwen3_next import FAMILIES, REFERENCE, SHAPE, perturb, random_hf  # noqa: E402

PROMPT = [5, 7, 9, 11, 0, 3]  # id 0 too: transformers is told it is no padding
NEW = 8


def _generated(capsys, checkpoint) -> list[int]:
    """tools/generate.py's greedy ids (the checkpoint has no tokenizer: ids in, ids out)."""
    capsys.readouterr()
    assert generate.main(["--load", str(checkpoint), "--prompt", " ".join(map(str, PROMPT)), "--temperature", "0",
                          "--max-new-tokens", str(NEW)]) == 0
    return [int(t) for t in capsys.readouterr().out.split()]


def _hf_greedy(model) -> list[int]:
    model.generation_config.eos_token_id = None
    prompt = torch.tensor([PROMPT])
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=NEW, do_sample=False,
                         pad_token_id=0)
    return out[0].tolist()


def _same_weights(a, b) -> bool:
    before, after = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_converted_qwen3_next_fine_tunes_alike_at_tp2_and_cp2_and_exports_back(tmp_path, capsys):
    hf = random_hf("qwen3_next", tmp_path / "hf")
    mz = tmp_path / "mz"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(mz)]) == 0
    config, _ = load_full(str(mz))
    assert (config.hf_model_type, config.linear_attention_freq, config.moe_layer_freq) == (
        "qwen3_next", (1, 0, 1, 1), (1, 1, 0, 1))
    assert _generated(capsys, mz) == _hf_greedy(hf)

    start = ["--pretrained-checkpoint", str(mz)]
    tune = TUNE + ["--seq-length", "80"]
    one = losses(1, start + ["--save", str(tmp_path / "ft"), "--save-interval", "3"], tmp_path / "one.jsonl", tune)
    tp2 = losses(2, start + ["--tp", "2"], tmp_path / "tp2.jsonl", tune)
    cp2 = losses(2, start + ["--context-parallel-size", "2"], tmp_path / "cp2.jsonl", tune)
    assert sorted(one) == sorted(tp2) == sorted(cp2) == [1, 2, 3]
    for i in one:
        for other in (tp2, cp2):
            assert other[i] == pytest.approx(one[i], abs=2e-5), (one, tp2, cp2)

    assert convert_to_hf.main(["--load", str(mz), "--output", str(tmp_path / "back")]) == 0
    assert _same_weights(tmp_path / "hf", tmp_path / "back")
    back = transformers.AutoConfig.from_pretrained(str(tmp_path / "back"))
    assert (back.model_type, back.layer_types, back.mlp_only_layers) == ("qwen3_next", hf.config.layer_types, [2])

    assert convert_to_hf.main(["--load", str(tmp_path / "ft"), "--output", str(tmp_path / "ft_hf")]) == 0
    tuned = load_file(str(tmp_path / "ft_hf" / "model.safetensors"))
    key = "model.layers.0.linear_attn.A_log"
    assert not torch.equal(tuned[key], load_file(str(tmp_path / "back" / "model.safetensors"))[key])
    tuned_hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ft_hf"), **REFERENCE).eval()
    assert _generated(capsys, tmp_path / "ft") == _hf_greedy(tuned_hf)


def test_a_multimodal_qwen3_5_converts_as_its_text_model(tmp_path, capsys):
    """Streamed from Qwen3_5ForConditionalGeneration's layout (the vision tower dropped): transformers' greedy
    tokens, and back out as a Qwen3_5ForCausalLM with the text model's weights."""
    _, text = FAMILIES["qwen3_5_text"]
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=32, patch_size=2,
                  temporal_patch_size=1, num_position_embeddings=16)
    cfg = transformers.Qwen3_5Config(text_config={**SHAPE, **text}, vision_config=vision, tie_word_embeddings=True)
    hf = perturb(transformers.Qwen3_5ForConditionalGeneration(cfg))
    hf.save_pretrained(str(tmp_path / "hf"))
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(tmp_path / "mz")]) == 0
    assert _generated(capsys, tmp_path / "mz") == _hf_greedy(hf)
    assert convert_to_hf.main(["--load", str(tmp_path / "mz"), "--output", str(tmp_path / "back")]) == 0
    wrapper, after = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "back" /
                                                                                        "model.safetensors"))
    text = {k.replace("model.language_model.", "model."): v for k, v in wrapper.items() if k.startswith(
        "model.language_model.")}
    assert text.keys() == after.keys() and all(torch.equal(text[k], after[k]) for k in text)
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), **REFERENCE).eval()
    assert back.config.model_type == "qwen3_5_text"
    ids = torch.tensor([PROMPT * 12])  # 72 tokens
    text_only = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), **REFERENCE).eval()
    with torch.no_grad():  # transformers' own text model of the wrapper
        torch.testing.assert_close(back(ids).logits, text_only(ids).logits, atol=0, rtol=0)
