"""Multi-token prediction against a hand-written one-process reference of DeepSeek-V3's equations:
h'_i = M [RMSNorm(Emb(t_{i+k})); RMSNorm(h_i)], a transformer layer, its final norm, the shared head
(h^0: the main model's normed output, as Megatron-core's and DeepSeek's), and
L = lambda / D * sum_k CE_k over the global count of each depth's valid targets (uneven counts across
micro-batches give the global per-token gradient, not the mean of per-micro-batch means)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megazero.model.forward_context import ForwardContext
from megazero.model import GPTConfig, GPTModel
from megazero.model.metrics import step_metrics
from megazero.model.mtp import multi_token_targets

V = 64


def _config(**kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=V, seq_length=12,
                max_position_embeddings=12, position_embedding_type="rope", normalization="rmsnorm",
                activation="swiglu", add_bias_linear=False, hidden_dropout=0.0, attention_dropout=0.0,
                make_vocab_size_divisible_by=32, mtp_num_layers=2, mtp_loss_scaling_factor=0.3,
                tie_embeddings=False)
    return GPTConfig(**{**base, **kw})


def _reference_mtp(model: GPTModel, hidden: torch.Tensor, labels: torch.Tensor, targets, mask, rotary):
    """sum over depths of lambda / D * sum_i mask CE, written out from the paper (before normalisation)."""
    c = model.config
    sums, h, inputs = [], hidden, labels
    for k, layer in enumerate(model.mtp.layers):
        emb = F.embedding(inputs, model.embedding.weight).transpose(0, 1)  # [s, b, h]
        x = torch.cat([layer.enorm(emb), layer.hnorm(h)], dim=-1) @ layer.eh_proj.weight.t()
        h = layer.final_layernorm(layer.transformer_layer(x, ForwardContext(rotary)))
        logits = F.linear(h, model.output_layer.weight)[..., :c.vocab_size]  # [s, b, V]
        ce = F.cross_entropy(logits.reshape(-1, c.vocab_size), targets[k].t().reshape(-1),
                             reduction="none").view(logits.shape[:2]).t()  # [b, s]
        sums.append((ce * mask[k]).sum())
        inputs = targets[k]
    return torch.stack(sums)


def test_targets_shift_within_the_sequence_and_documents():
    labels = torch.arange(1, 9).view(1, 8)
    mask = torch.ones(1, 8)
    docs = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1]])
    targets, m = multi_token_targets(labels, mask, 2, docs)
    assert targets[0, 0].tolist() == [2, 3, 4, 5, 6, 7, 8, 0]
    assert targets[1, 0].tolist() == [3, 4, 5, 6, 7, 8, 0, 0]
    # depth 1: position 2 (doc 0) would read position 3 (doc 1); the last position has no target
    assert m[0, 0].tolist() == [1, 1, 0, 1, 1, 1, 1, 0]
    assert m[1, 0].tolist() == [1, 0, 0, 1, 1, 1, 0, 0]


@pytest.mark.parametrize("q_mla", [False, True])
def test_equals_hand_written_reference_with_global_normalisation(q_mla):
    extra = {}
    if q_mla:
        pytest.importorskip("megazero.model.attention.mla")
        extra = dict(multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=8,
                     qk_pos_emb_head_dim=4, v_head_dim=8, rope_type="rope")
    torch.manual_seed(0)
    c = _config(**extra)
    model = GPTModel(c).train()
    g = torch.Generator().manual_seed(1)
    micro = []
    for n_valid in (12, 5):  # uneven valid targets across the two micro-batches
        ids = torch.randint(0, V, (2, 12), generator=g)
        labels = torch.randint(0, V, (2, 12), generator=g)
        loss_mask = torch.zeros(2, 12)
        loss_mask[:, :n_valid] = 1.0
        micro.append((ids, labels, loss_mask) + multi_token_targets(labels, loss_mask, c.mtp_num_layers))
    counts = sum(m[4].sum(dim=(1, 2)) for m in micro)  # [D], over the whole "global batch"

    model.prepare_step(1.0, len(micro), counts, data_parallel_size=1)
    for ids, labels, loss_mask, targets, mask in micro:
        per_token = model(ids, labels=labels, mtp_targets=targets, mtp_mask=mask)
        lm = (per_token * loss_mask).sum() / loss_mask.sum()
        (lm / len(micro)).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    logged = step_metrics([model], len(micro), torch.device("cpu"))

    model.zero_grad()
    factor = c.mtp_loss_scaling_factor / c.mtp_num_layers
    total_mtp = torch.zeros(c.mtp_num_layers, dtype=torch.float64)
    for ids, labels, loss_mask, targets, mask in micro:
        x = model.embedding(ids).transpose(0, 1)
        rotary = model.rotary(torch.arange(ids.size(1)))
        for layer in model.layers:
            x = layer(x, ForwardContext(rotary))
        x = model.final_norm(x)
        per_token = model._token_loss(x, labels)
        lm = (per_token * loss_mask).sum() / loss_mask.sum()
        sums = _reference_mtp(model, x, labels, targets, mask, rotary)
        ((lm / len(micro)) + factor * (sums / counts).sum()).backward()
        total_mtp += (sums / counts).detach().double()
    for n, p in model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-6, msg=n)
    for k in range(c.mtp_num_layers):
        assert logged[f"mtp_{k + 1} loss"].item() == pytest.approx(total_mtp[k].item(), rel=1e-6)


def test_factor_zero_reaches_nothing_of_the_main_model():
    torch.manual_seed(0)
    with_mtp = GPTModel(_config(mtp_loss_scaling_factor=0.0)).train()
    torch.manual_seed(0)
    without = GPTModel(_config(mtp_num_layers=0)).train()
    ids, labels = torch.randint(0, V, (2, 12)), torch.randint(0, V, (2, 12))
    for m in (with_mtp, without):
        m(ids, labels=labels).mean().backward()
    mtp = {n: p for n, p in with_mtp.named_parameters()}
    for n, p in without.named_parameters():
        assert torch.equal(mtp[n].data, p.data), n  # the same initial weights: MTP's are keyed by their own names
        assert torch.equal(mtp[n].grad, p.grad), n


def test_eval_and_logits_skip_prediction_layers():
    torch.manual_seed(0)
    model = GPTModel(_config()).eval()
    ids = torch.randint(0, V, (1, 12))
    assert model(ids).shape[:2] == (1, 12)
    model(ids, labels=ids)
    assert model.mtp.take() == []
