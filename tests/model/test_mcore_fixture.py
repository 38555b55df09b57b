"""The megatron-core fixture (tests/mcore.py): its checkpoints have Megatron-LM's layout, and megatron-core loads
them at other layouts to the same logits, so the fixture and megatron-core's resharding agree."""

import json
import os

import torch

from megazero.model import GPTConfig
from tests.mcore import mcore_logits, requires_mcore, write_mcore_checkpoint

pytestmark = requires_mcore

LLAMA = GPTConfig(
    num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=48, vocab_size=100,
    make_vocab_size_divisible_by=64, position_embedding_type="rope", activation="swiglu", normalization="rmsnorm",
    add_bias_linear=False, tie_embeddings=False, max_position_embeddings=16, seq_length=8,
    hidden_dropout=0.0, attention_dropout=0.0)


def _tokens(config, seed=0):
    return torch.randint(0, config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(seed))


def test_llama_written_at_tp2_pp2_loads_at_other_layouts(tmp_path):
    write_mcore_checkpoint(str(tmp_path), LLAMA, tp=2, pp=2, iteration=7)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "7"
    iter_dir = tmp_path / "iter_0000007"
    assert json.loads((iter_dir / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = torch.load(iter_dir / "common.pt", weights_only=False)
    args = common["args"]
    assert (common["iteration"], common["checkpoint_version"]) == (7, 3.0)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.num_query_groups) == (2, 2, 2)
    assert args.swiglu and args.group_query_attention and args.untie_embeddings_and_output_weights
    assert (args.normalization, args.position_embedding_type, args.padded_vocab_size) == ("RMSNorm", "rope", 128)

    tokens = _tokens(LLAMA)
    one = mcore_logits(str(tmp_path), LLAMA, tokens)
    assert one.shape == (2, 8, 128) and one.dtype == torch.float32
    assert one.std() > 0.1  # random weights, not a constant output
    torch.testing.assert_close(mcore_logits(str(iter_dir), LLAMA, tokens, tp=2), one, rtol=1e-5, atol=1e-5)
