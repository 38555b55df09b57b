"""Kimi Delta Attention against transformers' KimiLinearDeltaAttention (its torch fallbacks, the low-rank decay and
output gate, the sigmoid-gated norm): a tiny random layer over 70 tokens (two chunks) gives transformers' output
within 1e-5, and so does the full-rank form; packed documents are exact; the layer equals itself at TP=2 (with and
without sequence parallelism), and a GPT with KDA layers run context-parallel (state passing, packed documents;
Megatron's heads all-to-all) equals the one-process run."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers", reason="the KDA reference is transformers' Kimi Linear")

from transformers.models.kimi_linear import modeling_kimi_linear as hf_kimi  # noqa: E402

from megazero import mpu  # noqa: E402
from megazero.model import GPTConfig, GPTModel  # noqa: E402
from megazero.model.attention.cp.input import context_parallel_context, prepare_context_parallel_input  # noqa: E402
from megazero.model.forward_context import ForwardContext  # noqa: E402
from megazero.model.gpt import materialize_  # noqa: E402
from megazero.model.recurrent.kimi_delta_attention import KimiDeltaAttention  # noqa: E402
from megazero.model.state_dict import gather_full_state_dict, gather_full_tensor  # noqa: E402
from tests.distributed import run_distributed  # noqa: E402
from tests.helpers import randn  # noqa: E402

H, N, D, K, T = 32, 4, 8, 4, 70


def hf_config():
    """Tiny Kimi Linear (its default pad/bos/eos ids lie beyond a tiny vocabulary: overridden)."""
    return transformers.KimiLinearConfig(
        vocab_size=64, hidden_size=H, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        v_head_dim=8, qk_nope_head_dim=8, num_experts=4, num_experts_per_tok=2, linear_head_dim=D,
        linear_num_heads=N, linear_conv_kernel_dim=K, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        rms_norm_eps=1e-5, layer_types=["linear_attention", "full_attention"])


def ours_config(**kw) -> GPTConfig:
    fields = dict(num_layers=2, hidden_size=H, num_attention_heads=4, vocab_size=64, seq_length=T,
                  max_position_embeddings=T, add_bias_linear=False, normalization="rmsnorm", layernorm_epsilon=1e-5,
                  experimental_attention_variant="kda", linear_attention_freq=2, linear_num_key_heads=N,
                  linear_num_value_heads=N, linear_key_head_dim=D, linear_value_head_dim=D, linear_conv_kernel_dim=K,
                  kda_f_lora_rank=D, kda_gate_lora_rank=D, hidden_dropout=0.0, attention_dropout=0.0)
    return GPTConfig(**{**fields, **kw})


def from_hf(hf, full_rank: bool = False) -> dict[str, torch.Tensor]:
    """transformers' weights under megazero's names (``full_rank``: the low-rank pairs multiplied out)."""
    fg = hf.forget_gate
    sd = {"in_proj_qk.weight": torch.cat([hf.q_proj.weight, hf.k_proj.weight]), "in_proj_v.weight": hf.v_proj.weight,
          "in_proj_b.weight": hf.b_proj.weight, "out_proj.weight": hf.o_proj.weight,
          "conv1d_weight": hf.conv1d.weight.squeeze(1), "A_log": fg.A_log.reshape(-1), "dt_bias": fg.dt_bias,
          "norm_weight": hf.o_norm.weight}
    for name, a, b in (("f", fg.f_a_proj, fg.f_b_proj), ("g", hf.g_a_proj, hf.g_b_proj)):
        if full_rank:
            sd[f"{name}_proj.weight"] = b.weight @ a.weight
        else:
            sd[f"{name}_a_proj.weight"], sd[f"{name}_b_proj.weight"] = a.weight, b.weight
    return {n: t.detach().clone() for n, t in sd.items()}


def pair(full_rank: bool = False, strong_decay: bool = False):
    """transformers' layer with random weights (A and dt_bias drawn as Kimi Linear initialises them, or, with
    ``strong_decay``, dt_bias ~ N(0, 1): decays per token down to ~e^-40) and ours with the same weights."""
    torch.manual_seed(0)
    hf = hf_kimi.KimiLinearDeltaAttention(hf_config(), layer_idx=0).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
        fg = hf.forget_gate
        fg.A_log.copy_(torch.empty_like(fg.A_log).uniform_(1, 16).log())
        if not strong_decay:
            dt = torch.empty_like(fg.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)).exp()
            fg.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))
    ours = KimiDeltaAttention(ours_config(**({"kda_f_lora_rank": None, "kda_gate_lora_rank": None}
                                             if full_rank else {})), tp_group=None, tp_size=1)
    ours.load_state_dict(from_hf(hf, full_rank))
    return hf, ours


@pytest.mark.parametrize("full_rank", [False, True])
def test_equals_transformers(full_rank):
    hf, ours = pair(full_rank)
    x = randn(2, T, H, seed=1)
    with torch.no_grad():
        want = hf(x)
        got = ours(x.transpose(0, 1)).transpose(0, 1)
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()


def test_equals_transformers_recurrent_rule_under_strong_decay(monkeypatch):
    """With decays far stronger than Kimi Linear's initial ones transformers' chunked fp32 rule drifts (~1e-5, from
    differences of long prefix sums); its token loop does not: the layer with that rule is matched within 1e-5."""
    hf, ours = pair(strong_decay=True)

    def recurrent(q, k, v, g, beta, chunk_size=64, **kw):
        return hf_kimi.recurrent_kimi_delta_attention(q, k, v, g, beta, **kw)

    monkeypatch.setattr(hf_kimi, "chunk_kimi_delta_attention", recurrent)
    x = randn(2, T, H, seed=1)
    with torch.no_grad():
        want = hf(x)
        got = ours(x.transpose(0, 1)).transpose(0, 1)
    assert (got - want).abs().max() < 1e-5, (got - want).abs().max()


def test_packed_documents_do_not_leak():
    _, ours = pair()
    x = randn(1, T, H, seed=2)
    starts = torch.zeros(1, T, dtype=torch.bool)
    starts[0, [0, 30]] = True  # the second document starts inside the first chunk
    context = ForwardContext(starts=starts)
    with torch.no_grad():
        y = ours(x.transpose(0, 1), context)
        x2 = x.clone()
        x2[:, 5:30] += randn(1, 25, H, seed=3)
        y2 = ours(x2.transpose(0, 1), context)
        alone = ours(x[:, 30:].transpose(0, 1))
    assert torch.equal(y[30:], y2[30:])
    assert not torch.equal(y[:30], y2[:30])
    torch.testing.assert_close(y[30:], alone, rtol=1e-5, atol=1e-6)


def _layer(config: GPTConfig, tp_group=None, tp_size: int = 1) -> KimiDeltaAttention:
    """Built on meta and initialised by name, as GPTModel does (the draws keyed by the parameters' names)."""
    m = KimiDeltaAttention(config, tp_group=tp_group, tp_size=tp_size, device="meta")
    materialize_(m, "cpu")
    torch.manual_seed(7)
    mpu.reset_parameters_in_order(m)
    return m


def test_initialisation():
    """FLA's and Megatron's: A in [1, 16], softplus(dt_bias) in [1e-3, 0.1], the convolution in +-1/sqrt(K), the
    norm 1; reset_parameters touches only the layer's own parameters."""
    m = _layer(ours_config(linear_num_key_heads=64, linear_num_value_heads=64))
    A = torch.exp(m.A_log)
    assert 1 <= A.min() and A.max() <= 16 and A.max() - A.min() > 10
    dt = torch.nn.functional.softplus(m.dt_bias)
    assert 1e-3 * (1 - 1e-5) <= dt.min() and dt.max() <= 0.1 * (1 + 1e-5) and dt.max() / dt.min() > 20
    bound = 1 / K ** 0.5
    assert m.conv1d_weight.abs().max() <= bound and m.conv1d_weight.std() > 0.8 * bound / 3 ** 0.5
    assert torch.equal(m.norm_weight, torch.ones(D))
    before = {n: p.clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        m.A_log.zero_()
    m.reset_parameters()
    for n, p in m.named_parameters():
        if "." in n:  # a projection's: it initialises itself
            assert torch.equal(p, before[n]), n
    assert (m.A_log > 0).all()


# ---- tensor parallelism -------------------------------------------------------------------------------------------

def _tensor_parallel(sequence_parallel: bool):
    tp, rank = dist.get_world_size(), dist.get_rank()
    x = randn(T, 2, H, seed=4)
    starts = torch.zeros(2, T, dtype=torch.bool)
    starts[:, [0, 30]] = True
    context = ForwardContext(starts=starts)
    weights = randn(T, 2, H, seed=11)
    ref = _layer(ours_config())
    ref_w = gather_full_state_dict(ref)
    xr = x.clone().requires_grad_(True)
    (ref(xr, context) * weights).sum().backward()

    mpu.initialize_model_parallel(tp)
    group = mpu.get_tensor_model_parallel_group()
    m = _layer(ours_config(sequence_parallel=sequence_parallel), group, tp)
    w = gather_full_state_dict(m)
    assert w.keys() == ref_w.keys()
    for k in w:
        assert torch.equal(w[k], ref_w[k]), f"initial {k} differs at tp={tp}"
    rows = slice(rank * T // 2, (rank + 1) * T // 2) if sequence_parallel else slice(None)  # SP: a sequence shard
    x_local = x[rows].clone().requires_grad_(True)
    y = m(x_local, context)
    (y * weights[rows]).sum().backward()
    grads = {n: gather_full_tensor(p.grad, p, group) for n, p in m.named_parameters()}
    y_ref = ref(x, context).detach()
    return rows, y.detach(), x_local.grad, grads, y_ref, xr.grad, {n: p.grad for n, p in ref.named_parameters()}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_equals_one_rank(sequence_parallel):
    for rows, y, gx, grads, y_ref, gx_ref, g_ref in run_distributed(2, _tensor_parallel, sequence_parallel):
        torch.testing.assert_close(y, y_ref[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx, gx_ref[rows], rtol=1e-5, atol=1e-6)
        assert grads.keys() == g_ref.keys()
        for n, g in grads.items():  # sums split over the ranks round differently: relative to the largest
            err, scale = (g - g_ref[n]).abs().max(), g_ref[n].abs().max()
            assert err <= 2e-6 * scale, (n, err, scale)


# ---- context parallelism (a GPT with KDA layers, as tests/model/test_recurrent_cp.py) ------------------------------

S, B, V = 32, 2, 96
CU = [0, 5, 8, 21, 32]  # document ends inside chunks (5, 21) and on a cut (8 at cp 2)


def _gpt_config(linear_cp: str) -> GPTConfig:
    return GPTConfig(linear_cp_comm_type=linear_cp, num_layers=2, hidden_size=32, num_attention_heads=4,
                     num_query_groups=2, vocab_size=V, seq_length=S, max_position_embeddings=S, hidden_dropout=0.0,
                     attention_dropout=0.0, position_embedding_type="rope", make_vocab_size_divisible_by=32,
                     attention_backend="sdpa", experimental_attention_variant="kda", linear_attention_freq=2,
                     linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8,
                     linear_value_head_dim=8, kda_f_lora_rank=8, kda_gate_lora_rank=8)


def _data():
    tokens = torch.randint(0, V, (B, S + 1), generator=torch.Generator().manual_seed(3))
    return tokens[:, :-1], tokens[:, 1:]


def _mask() -> torch.Tensor:
    doc = torch.repeat_interleave(torch.arange(len(CU) - 1), torch.tensor(CU).diff())
    return (doc[:, None] != doc[None, :]) | torch.ones(S, S, dtype=torch.bool).triu(1)


def _one_process(documents: bool):
    torch.manual_seed(0)
    model = GPTModel(_gpt_config("state_passing"))
    assert type(model.layers[0].self_attention).__name__ == "KimiDeltaAttention"
    ids, labels = _data()
    loss = model(ids, torch.arange(S), attention_mask=_mask() if documents else None, labels=labels)
    loss.sum().backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


class _Groups:
    def __init__(self, cp: int, rank: int) -> None:
        self.cp_size, self.cp_rank, self.cp_group = cp, rank, None


def _context_parallel(documents: bool, linear_cp: str):
    rank, cp = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPTModel(_gpt_config(linear_cp))
    ids, labels = _data()
    ctx = context_parallel_context(S, _Groups(cp, rank), "p2p", torch.device("cpu"))
    ctx, local, pos, mask = prepare_context_parallel_input(
        ctx, {"ids": ids, "labels": labels}, None, _mask() if documents else None,
        [CU] * B if documents else None, balance_documents=False)
    loss = model(local["ids"], pos, attention_mask=mask, labels=local["labels"], context_parallel=ctx)
    loss.sum().backward()
    grads = {}
    for n, p in model.named_parameters():
        dist.all_reduce(p.grad)
        grads[n] = p.grad
    return pos, loss.detach(), grads


@pytest.mark.parametrize("documents,linear_cp", [(False, "state_passing"), (True, "state_passing"), (True, "a2a")])
def test_context_parallel_equals_one_process(documents, linear_cp):
    ref_loss, ref_grads = _one_process(documents)
    for pos, loss, grads in run_distributed(2, _context_parallel, documents, linear_cp):
        torch.testing.assert_close(loss, ref_loss[:, pos], rtol=1e-5, atol=1e-6)
        for n, g in grads.items():
            err = (g - ref_grads[n]).abs().max()
            assert err <= 2e-6 + 1e-5 * ref_grads[n].abs().max(), (n, err, ref_grads[n].abs().max())
