"""Single-process GPTModel behaviour: shapes, attention backends, init contract, state dicts."""

import pytest
import torch

from megazero import mpu
from megazero.mpu.initializers import parameter_naming
from megazero.model import GPTModel, materialize_
from megazero.model.attention.core import core_attention, resolve_backend
from megazero.model.state_dict import gather_full_state_dict, load_full_state_dict
from tests.model.common import SEQ, batch, mean_loss, tiny_config


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_forward_shapes_and_ignored_labels(arch):
    config = tiny_config(arch)
    model = GPTModel(config)
    ids, labels = batch(config)
    logits = model(ids)
    assert logits.shape == (2, SEQ, config.padded_vocab_size) and logits.dtype == torch.float32
    loss = model(ids, labels=labels)
    assert loss.shape == (2, SEQ) and loss.dtype == torch.float32
    assert (loss[0, :3] == 0).all() and (loss[:, 3:] > 0).all()
    ref = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    torch.testing.assert_close(loss.flatten(), ref)
    assert list(model.parameters(recurse=False)) == []  # the contract: GPTModel owns no direct parameters


def test_attention_backends_agree():
    g = torch.Generator().manual_seed(0)
    s, b, n, groups, d = 12, 2, 8, 2, 16
    q, k, v = (torch.randn(s, b, h, d, generator=g) for h in (n, groups, groups))
    mask = torch.rand(b, 1, s, s, generator=g) > 0.7
    mask[..., 0] = False  # every query keeps at least its first key
    for m in (None, mask, mask[0, 0]):
        math = core_attention(q, k, v, backend="math", attention_mask=m)
        sdpa = core_attention(q, k, v, backend="sdpa", attention_mask=m)
        assert math.shape == (s, b, n * d)
        torch.testing.assert_close(sdpa, math, atol=1e-5, rtol=1e-5)
    # the mask comes on top of causality: an all-False mask changes nothing
    torch.testing.assert_close(core_attention(q, k, v, attention_mask=torch.zeros(s, s, dtype=torch.bool)),
                               core_attention(q, k, v))


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_model_backends_agree(arch):
    config = tiny_config(arch)
    ids, _ = batch(config)
    outs = {}
    for backend in ("sdpa", "math", "auto"):
        torch.manual_seed(0)
        outs[backend] = GPTModel(config.replace(attention_backend=backend))(ids)
    torch.testing.assert_close(outs["sdpa"], outs["math"], atol=1e-5, rtol=1e-5)
    assert torch.equal(outs["auto"], outs["sdpa"])  # auto = sdpa on CPU


def test_flash_backend_explains_why_it_cannot_run():
    q = torch.zeros(4, 1, 2, 8)
    assert resolve_backend("auto", q, has_mask=False) == "sdpa"
    with pytest.raises(RuntimeError, match="attention_backend='flash' cannot run: .*needs CUDA.*float16 or bfloat16"):
        resolve_backend("flash", q, has_mask=False)


def test_position_ids_and_mask():
    config = tiny_config("llama")
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    ids, _ = batch(config)
    with torch.no_grad():
        base = model(ids)
        torch.testing.assert_close(model(ids, position_ids=torch.arange(SEQ).expand(2, SEQ)), base)
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1)
        torch.testing.assert_close(model(ids, attention_mask=causal), base)
        # masking out the first token for everyone but itself changes later positions only
        m = torch.zeros(SEQ, SEQ, dtype=torch.bool)
        m[1:, 0] = True
        out = model(ids, attention_mask=m)
        torch.testing.assert_close(out[:, 0], base[:, 0])
        assert not torch.allclose(out[:, 1:], base[:, 1:])


@pytest.mark.parametrize("arch", ["gpt", "llama"])
def test_meta_then_module_by_module_materialization_gives_the_same_weights(arch):
    config = tiny_config(arch)
    torch.manual_seed(42)
    whole = GPTModel(config)
    meta = GPTModel(config, device="meta")
    torch.manual_seed(42)
    names: dict = {}  # normal weights are keyed by their names in the model (mpu.initializers)
    owners = {id(m): n for n, m in meta.named_modules()}
    with parameter_naming(names):
        for module in mpu.modules_with_direct_parameters(meta):
            materialize_(module, "cpu", recurse=False)
            prefix = owners[id(module)]
            names.update({id(p): f"{prefix}.{n}" if prefix else n for n, p in module.named_parameters(recurse=False)})
            module.reset_parameters()
    for (name, a), (_, b) in zip(whole.named_parameters(), meta.named_parameters()):
        assert torch.equal(a, b), name
        for attr in ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel"):
            assert getattr(a, attr, None) == getattr(b, attr, None), (name, attr)
    # and the whole model is exactly reset_parameters_in_order after seeding
    torch.manual_seed(42)
    mpu.reset_parameters_in_order(meta)
    assert all(torch.equal(a, b) for a, b in zip(whole.parameters(), meta.parameters()))


def test_load_full_state_dict_is_strict_and_clear():
    config = tiny_config("gpt")
    src, dst = GPTModel(config), GPTModel(config)
    sd = gather_full_state_dict(src)
    load_full_state_dict(dst, sd)
    assert all(torch.equal(a, b) for a, b in zip(src.parameters(), dst.parameters()))
    bad = dict(sd)
    bad.pop("final_norm.bias")
    bad["extra.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match=r"missing keys \['final_norm.bias'\], unexpected keys \['extra.weight'\]"):
        load_full_state_dict(dst, bad)
    bad = dict(sd, **{"embedding.weight": torch.zeros(128, 64)})
    with pytest.raises(ValueError, match=r"embedding.weight: checkpoint \(128, 64\) vs model \(96, 64\)"):
        load_full_state_dict(dst, bad)


def test_training_drives_the_loss_down():
    config = tiny_config("llama", hidden_size=32, num_attention_heads=4, num_query_groups=2)
    torch.manual_seed(0)
    model = GPTModel(config)
    ids, labels = batch(config, seed=3, batch_size=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for _ in range(50):
        loss = mean_loss(model(ids, labels=labels), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.25 * losses[0], losses


def test_bf16_parameters_run():
    config = tiny_config("llama")
    ids, labels = batch(config)
    torch.manual_seed(0)
    ref = mean_loss(GPTModel(config)(ids, labels=labels), labels)
    torch.manual_seed(0)
    model = GPTModel(config.replace(params_dtype=torch.bfloat16))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    loss = model(ids, labels=labels)
    assert loss.dtype == torch.float32
    mean_loss(loss, labels).backward()
    assert abs(mean_loss(loss, labels).item() - ref.item()) < 0.05
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in model.parameters())
