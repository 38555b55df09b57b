"""A Kimi Linear (Kimi Delta Attention beside multi-latent attention without RoPE, a dense MLP then sigmoid-routed
mixtures with a shared expert) through the user's commands: tools/convert_from_hf.py (streamed layer by layer),
tools/generate.py (transformers' greedy tokens, its cache carrying KDA's state), pretrain_gpt.py fine-tuning from the
import in one process, at tp 2 and at cp 2 (the same losses: KDA split by heads, its state passed across the context
chunks), and tools/convert_to_hf.py back to a model transformers loads weight for weight."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from megazero.cli import convert_from_hf, convert_to_hf  # noqa: E402
from megazero.model.interop.hf import import_from_hf  # noqa: E402
from megazero.model.state_dict import load_full  # noqa: E402
from tests.cli.test_hf_nemotron_h import _generated, _hf_greedy  # noqa: E402
from tests.cli.test_hf_round_trip import TUNE, losses  # noqa: E402
from tests.model.test_hf_kimi_linear import REFERENCE, random_hf  # noqa: E402


def test_a_converted_kimi_linear_generates_fine_tunes_alike_at_tp2_and_cp2_and_exports_back(tmp_path, capsys):
    hf = random_hf(tmp_path / "hf")
    mz = tmp_path / "mz"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(mz)]) == 0
    config, streamed = load_full(str(mz))
    whole_config, whole = import_from_hf(str(tmp_path / "hf"))
    assert config == whole_config and all(torch.equal(streamed[k], whole[k]) for k in whole)
    assert _generated(capsys, mz) == _hf_greedy(hf)

    start = ["--pretrained-checkpoint", str(mz)]
    tune = TUNE + ["--seq-length", "32"]
    one = losses(1, start, tmp_path / "one.jsonl", tune)
    tp2 = losses(2, start + ["--tp", "2"], tmp_path / "tp2.jsonl", tune)
    cp2 = losses(2, start + ["--context-parallel-size", "2"], tmp_path / "cp2.jsonl", tune)
    assert sorted(one) == sorted(tp2) == sorted(cp2) == [1, 2, 3]
    for i in one:
        for other in (tp2, cp2):
            assert other[i] == pytest.approx(one[i], abs=2e-5), (one, tp2, cp2)

    assert convert_to_hf.main(["--load", str(mz), "--output", str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "back"), **REFERENCE).eval()
    before, after = hf.state_dict(), back.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
