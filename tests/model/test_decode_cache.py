"""Incremental decoding with a DecodeCache equals recomputing the whole context every step.

Greedy generate() with the cache (a forward over the prompt, then one over each new token) against the same
model without it (the context re-run every step): the same tokens, and every step's logits within 1e-5, for a
GPT with learned positions, a Llama-style GPT with sliding windows on every other layer and learned sinks, a
Qwen3-Next-style stack (Gated DeltaNet and gated attention), multi-latent attention, a Nemotron-H-style
Mamba-2 hybrid and a Kimi-Linear-style stack (Kimi Delta Attention beside attention); the same tokens at tp 2. Then the work: with the cache a step runs one token through every
mixer, the recurrent rule as one recurrent step from the cached state, whose size does not grow.
"""

from __future__ import annotations

import pytest
import torch

from megazero import mpu
from megazero.model import GPTModel
from megazero.model.decode_cache import DecodeCache, KeyValues, RecurrentState
from megazero.model.recurrent import gated_delta_net, mamba
from megazero.model.sampling import generate
from tests.distributed import run_distributed
from tests.model.common import tiny_config

SEED, PROMPT = 1234, 5
GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
           linear_conv_kernel_dim=4)
LONG = dict(seq_length=64, max_position_embeddings=64)
CONFIGS = {
    # learned positions: the prompt and the new tokens fit seq_length (16)
    "gpt": lambda: tiny_config("gpt"),
    # windows of 3 keys on every other layer, learned sinks, key norms, GQA, RoPE
    "llama_windows_sinks": lambda: tiny_config("llama", **LONG, num_layers=3, qk_layernorm=True, window_size=(3, 0),
                                               window_attn_skip_freq=2, softmax_type="learnable"),
    "qwen3_next": lambda: tiny_config("llama", **LONG, **GDN, num_layers=4, experimental_attention_variant="gated_delta_net",
                                      linear_attention_freq=2, attention_output_gate=True, qk_layernorm=True),
    # Mamba-2, attention and an MLP as three layers (groups divisible by tp 2)
    "nemotron_h": lambda: tiny_config("llama", **LONG, num_layers=3, hybrid_layer_pattern="M*-", mamba_num_heads=4,
                                      mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=8, linear_conv_kernel_dim=4),
    "mla": lambda: tiny_config("llama", **LONG, num_attention_heads=4, num_query_groups=None, multi_latent_attention=True,
                               q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6),
    # Kimi Delta Attention (a decay per key channel, low-rank decay and gate) beside attention
    "kimi_linear": lambda: tiny_config("llama", **LONG, **dict(GDN, linear_num_value_heads=2), num_layers=4,
                                       experimental_attention_variant="kda", linear_attention_freq=2,
                                       kda_f_lora_rank=8, kda_gate_lora_rank=8),
}
NEW_TOKENS = {"gpt": 10}  # the rest: 24, past the cache's first buffer of 16 keys


def _prompt(config, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, config.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(3))


def _generate(model: GPTModel, prompt: torch.Tensor, new: int, use_cache: bool) -> tuple[torch.Tensor, list]:
    """Greedy tokens and each forward's last-position logits (of the real vocabulary, gathered over TP)."""
    steps = []
    vocab = model.config.vocab_size

    def keep(module, args, out):
        steps.append(mpu.gather_from_tensor_model_parallel_region(out[:, -1]).clone()[:, :vocab])

    hook = model.register_forward_hook(keep)
    try:
        tokens = generate(model, prompt, new, seq_length=model.config.seq_length, temperature=0.0,
                          use_cache=use_cache)
    finally:
        hook.remove()
    return tokens, steps


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_with_the_cache_equals_recomputing_the_context(name):
    config = CONFIGS[name]()
    torch.manual_seed(SEED)
    model = GPTModel(config)
    prompt, new = _prompt(config), NEW_TOKENS.get(name, 24)
    ref_tokens, ref_logits = _generate(model, prompt, new, use_cache=False)
    tokens, logits = _generate(model, prompt, new, use_cache=True)
    assert torch.equal(tokens, ref_tokens)
    assert len(logits) == len(ref_logits) == new
    worst = max((a - b).abs().max().item() for a, b in zip(logits, ref_logits))
    assert worst <= 1e-5, f"{name}: the cached steps' logits differ by {worst}"
    scale = max(b.abs().max().item() for b in ref_logits)
    assert scale > 1e-2, f"{name}: logits of {scale} would make the tolerance meaningless"


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_sequence_fed_in_pieces_gives_the_logits_of_one_forward(name):
    # Pieces of several tokens after the first: the windows' and the causal masks offset by the cached length,
    # the recurrent rules' chunks from the cached state.
    config = CONFIGS[name]()
    torch.manual_seed(SEED)
    model = GPTModel(config).eval()
    ids = torch.randint(0, config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    cache, pieces = DecodeCache(), []
    with torch.no_grad():
        whole = model(ids)[..., :config.vocab_size]
        for lo, hi in ((0, 4), (4, 7), (7, 8), (8, 16)):
            pieces.append(model(ids[:, lo:hi], cache=cache)[..., :config.vocab_size])
    assert cache.length == 16
    torch.testing.assert_close(torch.cat(pieces, dim=1), whole, atol=1e-5, rtol=0)


def _tensor_parallel(name: str) -> list:
    mpu.initialize_model_parallel(2)
    config = CONFIGS[name]()
    torch.manual_seed(SEED)
    model = GPTModel(config)
    prompt, new = _prompt(config), NEW_TOKENS.get(name, 24)
    assert model.decode_cache_refusal() is None
    cached, _ = _generate(model, prompt, new, use_cache=True)
    recomputed, _ = _generate(model, prompt, new, use_cache=False)
    return [cached.tolist(), recomputed.tolist()]


@pytest.mark.parametrize("name", ["llama_windows_sinks", "qwen3_next", "nemotron_h", "mla", "kimi_linear"])
def test_tensor_parallel_decoding_gives_the_tokens_of_one_process(name):
    config = CONFIGS[name]()
    torch.manual_seed(SEED)
    one, _ = _generate(GPTModel(config), _prompt(config), NEW_TOKENS.get(name, 24), use_cache=True)
    for cached, recomputed in run_distributed(2, _tensor_parallel, name):
        assert cached == recomputed == one.tolist()


KERNELS = [(gated_delta_net, "gated_delta_rule"), (gated_delta_net, "recurrent_gated_delta_rule"),
           (mamba, "ssd_scan"), (mamba, "recurrent_ssd_scan")]


def test_a_step_runs_one_token_and_one_recurrent_step_from_a_state_that_does_not_grow(monkeypatch):
    config = tiny_config("llama", **LONG, **GDN, num_layers=3, hybrid_layer_pattern="MG-", mamba_num_heads=4,
                         mamba_head_dim=16, mamba_num_groups=2, mamba_state_dim=8)
    torch.manual_seed(SEED)
    model = GPTModel(config).eval()
    calls = []  # (kernel, tokens, the initial state's shape)
    for module, kernel in KERNELS:
        def counted(*args, _real=getattr(module, kernel), _name=kernel, **kw):
            state = kw["initial_state"]
            calls.append((_name, args[0].size(1), None if state is None else tuple(state.shape)))
            return _real(*args, **kw)

        monkeypatch.setattr(module, kernel, counted)
    mixer_tokens = []
    for layer in model.layers[:2]:
        getattr(layer, layer._mixer_name).register_forward_pre_hook(lambda m, a: mixer_tokens.append(a[0].size(0)))
    cache, prompt = DecodeCache(), _prompt(config, batch=1)
    with torch.no_grad():
        model(prompt, cache=cache)
        assert calls == [("ssd_scan", PROMPT, None), ("gated_delta_rule", PROMPT, None)]
        sizes = {n: (e.conv.shape, e.state.shape) for n, e in cache.layers().items()}
        calls.clear(), mixer_tokens.clear()
        for step in range(20):
            model(prompt[:, -1:], cache=cache)
        assert cache.length == PROMPT + 20
    assert mixer_tokens == [1] * 40
    ssd, delta = (1, 4, 16, 8), (1, GDN["linear_num_value_heads"], GDN["linear_key_head_dim"], GDN["linear_value_head_dim"])
    assert calls == [("recurrent_ssd_scan", 1, ssd), ("recurrent_gated_delta_rule", 1, delta)] * 20
    assert {n: (e.conv.shape, e.state.shape) for n, e in cache.layers().items()} == sizes
    assert sizes == {0: ((1, 3, 4 * 16 + 2 * 2 * 8), ssd), 1: ((1, 3, 2 * 2 * 8 + 4 * 8), delta)}  # [x; B; C], [q; k; v]
    assert all(e.state.dtype == torch.float32 for e in cache.layers().values())


def test_a_window_layer_keeps_only_the_keys_its_next_queries_see():
    kv, full = KeyValues(window=3), KeyValues()
    g = torch.Generator().manual_seed(0)
    seen = []
    for position, n in [(0, 5), (5, 1), (6, 2), *((p, 1) for p in range(8, 60))]:
        k, v = torch.randn(n, 2, 1, 4, generator=g), torch.randn(n, 2, 1, 6, generator=g)
        seen.append((k, v))
        keys, values, first = kv.extend(k, v, position)
        all_keys, all_values, zero = full.extend(k, v, position)
        every_k, every_v = torch.cat([s[0] for s in seen]), torch.cat([s[1] for s in seen])
        assert zero == 0 and torch.equal(all_keys, every_k) and torch.equal(all_values, every_v)
        assert first == max(0, position - 3)  # the first new query sees 3 keys back
        assert torch.equal(keys, every_k[first:]) and torch.equal(values, every_v[first:])
    assert kv.keys.size(0) <= 16 < full.keys.size(0)  # the window's buffer is compacted, not grown
    with pytest.raises(ValueError, match="in order"):
        kv.extend(k, v, 100)


def test_the_convolution_keeps_the_last_inputs_across_calls():
    state, x = RecurrentState(), torch.arange(2 * 7 * 3, dtype=torch.float32).view(2, 7, 3)
    assert state.convolution_halo(x[:, :2], 3) is None
    assert torch.equal(state.conv, torch.cat([torch.zeros(2, 1, 3), x[:, :2]], dim=1))
    assert torch.equal(state.convolution_halo(x[:, 2:6], 3), torch.cat([torch.zeros(2, 1, 3), x[:, :2]], dim=1))
    assert torch.equal(state.conv, x[:, 3:6])


def test_a_cache_is_refused_where_it_cannot_run():
    config = tiny_config("llama", **LONG)
    torch.manual_seed(SEED)
    stage = GPTModel(config, post_process=False)
    with pytest.raises(ValueError, match="pipeline stage"):
        generate(stage, _prompt(config), 2, seq_length=64, use_cache=True)
    model = GPTModel(config)
    with pytest.raises(ValueError, match="attention_mask"):
        model(_prompt(config), attention_mask=torch.zeros(PROMPT, PROMPT, dtype=torch.bool), cache=DecodeCache())
    learned = GPTModel(tiny_config("gpt"))
    with pytest.raises(ValueError, match="learned"):  # past seq_length learned positions recompute the cut context
        generate(learned, _prompt(config), 16, seq_length=16, use_cache=True)
