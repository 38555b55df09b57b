"""The megatron-core fixture (tests/mcore.py): its checkpoints have Megatron-LM's layout, and megatron-core loads
them at other layouts to the same logits, so the fixture and megatron-core's resharding agree. The tools read the
same Megatron-LM checkpoint: tools/convert_to_hf.py exports it to a model whose logits (transformers') are
megatron-core's, and tools/generate.py continues a prompt with that model's greedy tokens."""

import json
import os

import pytest
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


@pytest.fixture(scope="module")
def llama_tp2_pp2(tmp_path_factory):
    """A Llama megatron-core wrote at tp 2 x pp 2, and megatron-core's logits of it at tp 1 x pp 1."""
    path = tmp_path_factory.mktemp("mcore_llama")
    write_mcore_checkpoint(str(path), LLAMA, tp=2, pp=2, iteration=7)
    tokens = _tokens(LLAMA)
    return path, tokens, mcore_logits(str(path), LLAMA, tokens)


def test_llama_written_at_tp2_pp2_loads_at_other_layouts(llama_tp2_pp2):
    tmp_path, tokens, one = llama_tp2_pp2
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text() == "7"
    iter_dir = tmp_path / "iter_0000007"
    assert json.loads((iter_dir / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
    common = torch.load(iter_dir / "common.pt", weights_only=False)
    args = common["args"]
    assert (common["iteration"], common["checkpoint_version"]) == (7, 3.0)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.num_query_groups) == (2, 2, 2)
    assert args.swiglu and args.group_query_attention and args.untie_embeddings_and_output_weights
    assert (args.normalization, args.position_embedding_type, args.padded_vocab_size) == ("RMSNorm", "rope", 128)
    # Megatron-LM's --no-save-optim save of a local-spec run: no optimizer, no scheduler; its argument defaults
    assert "optimizer" not in common and "opt_param_scheduler" not in common and args.no_save_optim
    assert (args.transformer_impl, args.consumed_train_samples, args.lr_warmup_init) == ("local", 7 * 8, 0.0)

    assert one.shape == (2, 8, 128) and one.dtype == torch.float32
    assert one.std() > 0.1  # random weights, not a constant output
    torch.testing.assert_close(mcore_logits(str(iter_dir), LLAMA, tokens, tp=2), one, rtol=1e-5, atol=1e-5)


def test_the_tools_read_a_megatron_lm_torch_dist_checkpoint(llama_tp2_pp2, tmp_path, capsys):
    transformers = pytest.importorskip("transformers", reason="the export needs transformers")
    from megazero.cli import convert_to_hf, generate

    path, tokens, one = llama_tp2_pp2
    assert convert_to_hf.main(["--load", str(path), "--output", str(tmp_path / "hf")]) == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(hf).__name__ == "LlamaForCausalLM"
    v = hf.config.vocab_size  # the padded vocabulary: Megatron-LM's softmax covers every row
    assert v == one.shape[-1] == 128
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, one, rtol=1e-4, atol=1e-4)

    prompt = tokens[0, :4].tolist()
    hf.generation_config.eos_token_id = None
    expected = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False, pad_token_id=0)[0].tolist()
    capsys.readouterr()
    assert generate.main(["--load", str(path), "--prompt", " ".join(map(str, prompt)), "--temperature", "0",
                          "--max-new-tokens", "6"]) == 0
    ours = [int(w) for w in capsys.readouterr().out.split()]  # NullTokenizer: ids as text, stopping at its end
    assert ours == expected[:len(ours)] and (len(ours) == len(expected) or ours[-1] == v - 1), (ours, expected)
