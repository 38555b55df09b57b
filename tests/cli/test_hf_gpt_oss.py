"""A gpt-oss through the user's commands: tools/convert_from_hf.py, then pretrain_gpt.py fine-tuning from it in one
process, at ep 2, pp 2 and cp 2 (the same losses: sinks, windows shorter than a cp chunk, the biased router and
the clamped experts in every layout), tools/convert_to_hf.py back bit for bit, and the fine-tuned checkpoint
exported to a model transformers runs greedily as tools/generate.py does."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from safetensors.torch import load_file  # noqa: E402

from megazero.cli import convert_from_hf, convert_to_hf, generate  # noqa: E402
from megazero.model.state_dict import load_full  # noqa: E402
from tests.cli.test_hf_round_trip import TUNE, losses  # noqa: E402
from tests.model.test_hf_gpt_oss import REFERENCE, WINDOW, random_hf  # noqa: E402

PROMPT = [5, 7, 9, 11]
NEW = 8


def _generated(capsys, checkpoint) -> list[int]:
    """tools/generate.py's greedy ids (the checkpoint has no tokenizer: ids in, ids out)."""
    capsys.readouterr()
    assert generate.main(["--load", str(checkpoint), "--prompt", " ".join(map(str, PROMPT)), "--temperature", "0",
                          "--max-new-tokens", str(NEW)]) == 0
    return [int(t) for t in capsys.readouterr().out.split()]


@pytest.mark.slow
def test_a_converted_gpt_oss_fine_tunes_alike_at_ep2_pp2_and_cp2_and_exports_back(tmp_path, capsys):
    random_hf(tmp_path / "hf", layers=4)
    mz = tmp_path / "mz"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(mz)]) == 0
    config, _ = load_full(str(mz))
    assert ([config.layer_window(i) for i in range(4)], config.softmax_type, config.moe_router_bias) == (
        [WINDOW - 1, None, WINDOW - 1, None], "learnable", True)

    start = ["--pretrained-checkpoint", str(mz)]  # TUNE's 16 tokens: a cp 2 chunk of 4 is shorter than the window
    one = losses(1, start + ["--save", str(tmp_path / "ft"), "--save-interval", "3"], tmp_path / "one.jsonl", TUNE)
    ep2 = losses(2, start + ["--expert-model-parallel-size", "2"], tmp_path / "ep2.jsonl", TUNE)
    pp2 = losses(2, start + ["--pp", "2"], tmp_path / "pp2.jsonl", TUNE)
    cp2 = losses(2, start + ["--context-parallel-size", "2"], tmp_path / "cp2.jsonl", TUNE)
    assert sorted(one) == sorted(ep2) == sorted(pp2) == sorted(cp2) == [1, 2, 3]
    for i in one:
        for other in (ep2, pp2, cp2):
            assert other[i] == pytest.approx(one[i], abs=2e-5), (one, ep2, pp2, cp2)

    assert convert_to_hf.main(["--load", str(mz), "--output", str(tmp_path / "back")]) == 0
    before = load_file(str(tmp_path / "hf" / "model.safetensors"))
    after = load_file(str(tmp_path / "back" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    back = transformers.AutoConfig.from_pretrained(str(tmp_path / "back"))
    assert (back.model_type, back.sliding_window, back.layer_types[:2], back.rope_parameters["truncate"]) == (
        "gpt_oss", WINDOW, ["sliding_attention", "full_attention"], False)

    assert convert_to_hf.main(["--load", str(tmp_path / "ft"), "--output", str(tmp_path / "ft_hf")]) == 0
    tuned = load_file(str(tmp_path / "ft_hf" / "model.safetensors"))
    assert tuned.keys() == after.keys() and not torch.equal(tuned["model.layers.0.self_attn.sinks"],
                                                            after["model.layers.0.self_attn.sinks"])
    tuned_hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "ft_hf"), **REFERENCE).eval()
    tuned_hf.generation_config.eos_token_id = None
    expected = tuned_hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW, do_sample=False, pad_token_id=0)
    assert _generated(capsys, tmp_path / "ft") == expected[0].tolist()
