"""The parts of the mixture-of-experts layer: the parameter names checkpoints and converters read, the
experts' ``is_expert`` / ``allreduce`` marks (kept through a model built on the meta device and
materialized), and the router's losses and load figures on their own."""

from __future__ import annotations

import torch

from megazero.model import GPTModel
from megazero.model.config import GPTConfig
from megazero.model.init import init_methods
from megazero.model.mlp import MLP
from megazero.model.moe.experts import Experts
from megazero.model.moe.layer import AuxLossScale, MoELayer, Router, is_expert_parameter

H, E = 32, 4


def _config(**kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=8, max_position_embeddings=8,
                vocab_size=64, num_experts=E, moe_router_topk=2, add_bias_linear=False, hidden_dropout=0.0,
                attention_dropout=0.0, activation="swiglu", moe_ffn_hidden_size=16)
    return GPTConfig(**{**base, **kw}).validate()


def test_names_are_the_checkpoints_whatever_the_expert_parallel_rank():
    c = _config(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)
    layer = MoELayer(c, lambda: MLP(c, tp_group=None, tp_size=1, expert=True), tp_group=None, tp_size=1,
                     ep_group=None, ep_size=2, ep_rank=1, aux_scale=AuxLossScale(), init_method=init_methods(c)[0],
                     shared=lambda: MLP(c, tp_group=None, tp_size=1, expert=True, ffn_size=16))
    assert isinstance(layer.router, Router) and isinstance(layer.experts, Experts)
    assert sorted(n for n, _ in layer.named_parameters()) == sorted(
        ["router.weight", "shared_gate.weight", "shared_experts.linear_fc1.weight", "shared_experts.linear_fc2.weight"]
        + [f"experts.{e}.linear_fc{i}.weight" for e in (2, 3) for i in (1, 2)])


def test_expert_parameters_are_marked_through_a_meta_build():
    """GPTModel builds on the meta device and materializes: every routed expert's parameter keeps its
    marks, and nothing else has them."""
    model = GPTModel(_config(moe_shared_expert_intermediate_size=16, moe_layer_freq=[0, 1]))
    names = dict(model.named_parameters())
    experts = {n for n in names if ".mlp.experts." in n}
    assert experts and not any(p.is_meta for p in names.values())
    for name, p in names.items():
        want = name in experts
        assert is_expert_parameter(p) is want, name
        assert getattr(p, "allreduce", True) is not want, name  # Megatron's marker: False on the experts only
    stray = names["layers.0.mlp.linear_fc1.weight"]  # a dense layer's weight, marked by hand: the mark decides
    stray.is_expert = True
    assert is_expert_parameter(stray)


def test_the_router_owns_its_losses_and_figures():
    """The router alone: routing, the aux and z losses recorded with the load, and their gradient arriving
    in backward through the tensor the losses are attached to."""
    c = _config(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    scale = AuxLossScale(value=3.0)
    torch.manual_seed(0)
    router = Router(c, init_methods(c)[0], aux_scale=scale)
    tokens = torch.randn(16, H, generator=torch.Generator().manual_seed(1))
    routing = router(tokens, batch=2)
    assert routing.top.shape == (16, 2) and routing.drop is None and routing.slots is None
    (loss,), (load,), dropped = scale.take()
    assert torch.equal(loss, routing.aux.detach()) and load >= 1.0 and dropped == []
    y = torch.zeros(3, requires_grad=True)
    router.attach_losses(y, routing).sum().backward(retain_graph=True)
    got = router.weight.grad.clone()
    router.zero_grad()
    (3.0 * routing.aux).backward()  # the same losses' graph, as if 3 x aux were in the loss
    assert torch.equal(got, router.weight.grad) and got.abs().max() > 0


def test_capacity_drops_are_the_routers_and_recorded():
    c = _config(moe_expert_capacity_factor=0.5)
    scale = AuxLossScale()
    router = Router(c, init_methods(c)[0], aux_scale=scale)
    routing = router(torch.randn(32, H, generator=torch.Generator().manual_seed(2)), batch=4)
    assert routing.drop.shape == (32, 2)
    _, _, (dropped,) = scale.take()
    assert torch.equal(dropped, routing.drop.float().mean()) and dropped >= 0.5  # room for half the copies
    router.eval()
    router(torch.randn(32, H), batch=4)
    assert scale.take() == ([], [], [])  # evaluation records nothing
