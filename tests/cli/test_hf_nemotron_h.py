"""A Nemotron-H (Mamba-2, a sigmoid-routed mixture with a shared expert, attention and an MLP, each its own block)
through the user's commands: tools/convert_from_hf.py (streamed layer by layer), tools/generate.py (transformers'
greedy tokens), pretrain_gpt.py fine-tuning from the import in one process, at tp 2 and at cp 2 (the same losses:
Mamba split by groups, its state passed across the context chunks), tools/convert_to_hf.py back bit for bit, and
the fine-tuned checkpoint exported to a model transformers runs greedily as tools/generate.py does."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from safetensors.torch import load_file  # noqa: E402

from megazero.cli import convert_from_hf, convert_to_hf, generate  # noqa: E402
from megazero.model.state_dict import load_full  # noqa: E402
from tests.cli.test_hf_round_trip import TUNE, losses  # noqa: E402
from tests.model.test_hf_nemotron_h import REFERENCE, random_hf  # noqa: E402

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


def _weights(d) -> dict[str, torch.Tensor]:
    return load_file(str(d / "model.safetensors"))


def test_a_converted_nemotron_h_fine_tunes_alike_at_tp2_and_cp2_and_exports_back(tmp_path, capsys):
    hf = random_hf("moe", tmp_path / "hf")
    mz = tmp_path / "mz"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(mz)]) == 0
    config, _ = load_full(str(mz))
    assert (config.hybrid_layer_pattern, config.num_experts, config.mamba_num_groups) == ("ME*-M", 8, 2)
    assert _generated(capsys, mz) == _hf_greedy(hf)

    start = ["--pretrained-checkpoint", str(mz)]
    tune = TUNE + ["--seq-length", "32"]
    one = losses(1, start + ["--save", str(tmp_path / "ft"), "--save-interval", "3"], tmp_path / "one.jsonl", tune)
    tp2 = losses(2, start + ["--tp", "2"], tmp_path / "tp2.jsonl", tune)
    cp2 = losses(2, start + ["--context-parallel-size", "2"], tmp_path / "cp2.jsonl", tune)
    assert sorted(one) == sorted(tp2) == sorted(cp2) == [1, 2, 3]
    for i in one:
        for other in (tp2, cp2):
            assert other[i] == pytest.approx(one[i], abs=2e-5), (one, tp2, cp2)

    assert convert_to_hf.main(["--load", str(mz), "--output", str(tmp_path / "back")]) == 0
    before, after = _weights(tmp_path / "hf"), _weights(tmp_path / "back")
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    back = transformers.AutoConfig.from_pretrained(str(tmp_path / "back"))
    assert (back.model_type, back.layers_block_type, back.n_group, back.topk_group) == (
        "nemotron_h", hf.config.layers_block_type, 4, 2)

    assert convert_to_hf.main(["--load", str(tmp_path / "ft"), "--output", str(tmp_path / "ft_hf")]) == 0
    tuned = _weights(tmp_path / "ft_hf")
    for key in ("backbone.layers.0.mixer.A_log", "backbone.layers.1.mixer.gate.e_score_correction_bias"):
        assert not torch.equal(tuned[key], after[key]), key  # trained, the expert bias moved by the load
    tuned_hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ft_hf"), **REFERENCE).eval()
    assert _generated(capsys, tmp_path / "ft") == _hf_greedy(tuned_hf)
