"""A Qwen3 with Llama 3.1's RoPE scaling through the user's commands: tools/convert_from_hf.py, then pretrain_gpt.py
fine-tuning from it in one process, at tp 2 and at pp 2 (the same losses), and tools/convert_to_hf.py back bit for
bit. Megatron's --use-rope-scaling / --rope-scaling-factor reach the GPTConfig."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="HF interop tests need transformers")

from safetensors.torch import load_file  # noqa: E402

from megazero.cli import convert_from_hf, convert_to_hf  # noqa: E402
from megazero.config.arguments import ConfigError, parse_args  # noqa: E402
from megazero.model.state_dict import load_full  # noqa: E402
from tests.cli.test_hf_round_trip import FINETUNE, losses  # noqa: E402
from tests.model.test_hf_dense import LLAMA3, SHAPE  # noqa: E402

SHAPE_FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--vocab-size", "128"]


@pytest.mark.slow
def test_a_converted_qwen3_with_llama3_rope_fine_tunes_alike_at_tp2_and_pp2(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**SHAPE, head_dim=24, rope_parameters=LLAMA3))
    hf.save_pretrained(str(tmp_path / "hf"))
    mz = tmp_path / "mz"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(mz)]) == 0
    config, _ = load_full(str(mz))
    assert (config.qk_layernorm, config.head_dim, config.rope_type, config.original_max_position_embeddings) == (
        True, 24, "llama3", 16)

    one = losses(1, ["--pretrained-checkpoint", str(mz)], tmp_path / "one.jsonl")
    tp2 = losses(2, ["--pretrained-checkpoint", str(mz), "--tp", "2"], tmp_path / "tp2.jsonl")
    pp2 = losses(2, ["--pretrained-checkpoint", str(mz), "--pp", "2"], tmp_path / "pp2.jsonl")
    assert sorted(one) == sorted(tp2) == sorted(pp2) == [1, 2, 3]
    for i in one:
        assert tp2[i] == pytest.approx(one[i], abs=2e-5) and pp2[i] == pytest.approx(one[i], abs=2e-5), (one, tp2, pp2)

    assert convert_to_hf.main(["--load", str(mz), "--output", str(tmp_path / "back")]) == 0
    before, after = load_file(str(tmp_path / "hf" / "model.safetensors")), load_file(str(tmp_path / "back" / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    back = transformers.AutoConfig.from_pretrained(str(tmp_path / "back"))
    assert back.model_type == "qwen3" and back.rope_parameters["rope_type"] == "llama3"


def test_megatron_rope_scaling_flags_reach_the_model():
    base = FINETUNE + SHAPE_FLAGS
    m = parse_args(base + ["--use-rope-scaling", "--rope-scaling-factor", "16"], 1).model
    assert (m.rope_type, m.rotary_scaling_factor, m.low_freq_factor, m.high_freq_factor,
            m.original_max_position_embeddings) == ("llama3", 16.0, 1.0, 4.0, 8192)  # Megatron-core's values
    assert parse_args(base + ["--use-rope-scaling"], 1).model.rotary_scaling_factor == 8.0
    assert parse_args(base, 1).model.resolved_rope_type == "rope"
    with pytest.raises(ConfigError, match="--rope-scaling-factor 4 without --use-rope-scaling has no effect"):
        parse_args(base + ["--rope-scaling-factor", "4"], 1)
    with pytest.raises(ConfigError, match="one RoPE scaling per model"):
        parse_args(base + ["--use-rope-scaling", "--position-embedding-type", "yarn", "--rotary-scaling-factor", "4"], 1)



@pytest.mark.slow
def test_a_converted_qwen2_with_a_sliding_layer_fine_tunes_alike_at_cp2_and_pp2(tmp_path):
    """Its second layer slides over 5 keys (shorter than a cp 2 zigzag chunk of 8 tokens); the run keeps the
    pattern from the checkpoint and converts back with the same layer_types."""
    torch.manual_seed(0)
    hf = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SHAPE, use_sliding_window=True, sliding_window=5,
                                                                max_window_layers=1))
    hf.save_pretrained(str(tmp_path / "hf"))
    mz = tmp_path / "mz"
    assert convert_from_hf.main(["--input", str(tmp_path / "hf"), "--output", str(mz)]) == 0
    config, _ = load_full(str(mz))
    assert [config.layer_window(i) for i in range(2)] == [None, 4]

    one = losses(1, ["--pretrained-checkpoint", str(mz)], tmp_path / "one.jsonl")
    cp2 = losses(2, ["--pretrained-checkpoint", str(mz), "--context-parallel-size", "2"], tmp_path / "cp2.jsonl")
    pp2 = losses(2, ["--pretrained-checkpoint", str(mz), "--pp", "2"], tmp_path / "pp2.jsonl")
    assert sorted(one) == sorted(cp2) == sorted(pp2) == [1, 2, 3]
    for i in one:
        assert cp2[i] == pytest.approx(one[i], abs=2e-5) and pp2[i] == pytest.approx(one[i], abs=2e-5), (one, cp2, pp2)

    assert convert_to_hf.main(["--load", str(mz), "--output", str(tmp_path / "back")]) == 0
    back = transformers.AutoConfig.from_pretrained(str(tmp_path / "back"))
    assert (back.sliding_window, back.layer_types) == (5, ["full_attention", "sliding_attention"])
