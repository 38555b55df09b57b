"""The mixture-of-experts layer: routing (top-k, ties, weights), the auxiliary losses and their
gradients, and expert parallelism against one process on the same tokens: output, input gradient and
expert gradients bit-identical at EP 2 and 4, the router's gradient within 1e-6, and the bytes the
all-to-alls send equal to the rows that leave the rank."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from megazero.model.config import GPTConfig
from megazero.model.moe.layer import AuxLossScale, MoELayer, is_expert_parameter, route
from megazero.model.init import init_methods
from megazero.model.mlp import MLP
from tests.distributed import run_distributed

H, E, S, B = 32, 8, 24, 2
# gpt-oss's MLP and router: quick GEGLU with an offset and a clamp that bites at these weights, biases on
# every linear (the experts' fc2 bias once per expert whatever the TP, expert TP and EP) and on the router
GPT_OSS = dict(activation="quick_geglu", glu_linear_offset=1.0, activation_func_clamp_value=1.0,
               add_bias_linear=True, moe_router_bias=True)


def _config(**kw) -> GPTConfig:
    base = dict(num_layers=2, hidden_size=H, num_attention_heads=4, seq_length=S, max_position_embeddings=S,
                vocab_size=64, num_experts=E, moe_router_topk=2, add_bias_linear=False, hidden_dropout=0.0,
                attention_dropout=0.0, activation="swiglu", moe_ffn_hidden_size=48)
    return GPTConfig(**{**base, **kw}).validate()


def _layer(config, group=None, size=1, rank=0, scale=None) -> MoELayer:
    torch.manual_seed(3)
    layer = MoELayer(config, lambda: MLP(config, tp_group=None, tp_size=1, expert=True), tp_group=None, tp_size=1,
                     ep_group=group, ep_size=size, ep_rank=rank, aux_scale=scale or AuxLossScale(),
                     init_method=init_methods(config)[0])
    g = torch.Generator().manual_seed(5)  # every expert's weights by its global index, whatever the EP
    for p in layer.router.parameters():
        p.data.copy_(torch.randn(p.shape, generator=g))
    for e in range(E):
        shapes = [(96, H), (96,), (H, 48), (H,)] if config.add_bias_linear else [(96, H), (H, 48)]
        values = [torch.randn(s, generator=g) * 0.2 for s in shapes]
        if str(e) in layer.experts:
            for p, v in zip(layer.experts[str(e)].parameters(), values):
                p.data.copy_(v)
    return layer


def test_route_breaks_ties_by_expert_index_and_weights_as_asked():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.5], [2.0, 2.0, 2.0, 2.0]])
    top, w, probs = route(logits, 2, pre_softmax=False)
    assert top.tolist() == [[1, 2], [0, 1]]
    assert torch.allclose(w, torch.full((2, 2), 0.5)) and torch.allclose(probs.sum(-1), torch.ones(2))
    _, w_pre, _ = route(logits, 2, pre_softmax=True)  # Qwen2-MoE: the full softmax at the chosen, not renormalised
    assert torch.allclose(w_pre, probs.gather(1, top)) and (w_pre.sum(-1) < 1).all()


def test_aux_losses_and_their_gradient_in_backward():
    c = _config(moe_aux_loss_coeff=0.01, moe_z_loss_coeff=0.001)
    scale = AuxLossScale(value=50.0)
    layer = _layer(c, scale=scale)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(1), requires_grad=True)
    y = layer(x)
    (aux,), _, _ = scale.take()
    logits = x.detach().reshape(-1, H) @ layer.router.weight.detach().t()
    top, _, probs = route(logits, 2, False)
    n = S * B
    counts = torch.bincount(top.flatten(), minlength=E).float()
    want = 0.01 * E / (2 * n * n) * (probs.sum(0) * counts).sum() + 0.001 * torch.logsumexp(logits, -1).square().mean()
    assert torch.allclose(aux, want, rtol=1e-6)
    # backward gives the losses the gradient 50, as if 50 * aux had been added to the loss
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(2))
    (y * g).sum().backward()
    got = layer.router.weight.grad.clone()
    layer.zero_grad()
    scale.value = 0.0  # the same pass with the losses' gradient off ...
    (layer(x) * g).sum().backward()
    base = layer.router.weight.grad.clone()
    layer.zero_grad()
    logits = x.reshape(-1, H).float() @ layer.router.weight.float().t()
    (50.0 * layer.router.losses(logits, torch.softmax(logits, -1), route(logits, 2, False)[0])).backward()
    assert (got - base - layer.router.weight.grad).abs().max() <= 1e-6 * got.abs().max()  # ... plus the losses'
    assert (got - base).abs().max() > 1e-2 * got.abs().max()


def _ep_case(size: int):
    rank = dist.get_rank()
    c = _config()
    g = torch.Generator().manual_seed(9)
    xs = [torch.randn(S, B, H, generator=g) for _ in range(size)]  # each rank's tokens
    grads = [torch.randn(S, B, H, generator=g) for _ in range(size)]
    one = _layer(c)  # one process on every rank's tokens, in rank order
    x_all = torch.cat(xs, 0).requires_grad_()
    y_all = one(x_all)
    y_all.backward(torch.cat(grads, 0))
    mine = _layer(c, dist.group.WORLD, size, rank)
    mine.counter = {}
    x = xs[rank].clone().requires_grad_()
    y = mine(x)
    y.backward(grads[rank])
    rows = slice(rank * S, (rank + 1) * S)
    assert torch.equal(y, y_all[rows].detach()), (y - y_all[rows]).abs().max()
    assert torch.equal(x.grad, x_all.grad[rows])
    for e, expert in mine.experts.items():
        for (name, p), q in zip(expert.named_parameters(), one.experts[e].parameters()):
            assert torch.equal(p.grad, q.grad), (e, name, (p.grad - q.grad).abs().max())
    router = mine.router.weight.grad.clone()
    dist.all_reduce(router)  # the data-parallel sum of the replicated router's gradient
    err = ((router - one.router.weight.grad).abs().max() / one.router.weight.grad.abs().max()).item()
    assert err <= 1e-6, err
    # the rows that leave this rank, h fp32 each, dispatch and combine both ways
    top = route(x.detach().reshape(-1, H) @ mine.router.weight.detach().t(), 2, False)[0]
    away = int((top.flatten() // (E // size) != rank).sum())
    back = sum(int((route(xx.reshape(-1, H) @ mine.router.weight.detach().t(), 2, False)[0].flatten()
                    // (E // size) == rank).sum()) for r, xx in enumerate(xs) if r != rank)
    assert mine.counter == {"forward": (away + back) * H * 4, "backward": (away + back) * H * 4}, mine.counter
    return err


@pytest.mark.parametrize("size", [2, 4])
def test_expert_parallel_equals_one_process(size):
    run_distributed(size, _ep_case, size)


def test_over_capacity_keeps_each_experts_heaviest_or_earliest_copies():
    from megazero.model.moe.layer import over_capacity

    top = torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0]])
    w = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.5, 0.5], [0.7, 0.3]])
    # capacity ceil(4 * 2 / 4 * 1.0) = 2 copies per expert
    assert over_capacity(top, w, 4, 1.0, "probs").tolist() == [[False, True], [False, False], [True, False],
                                                               [False, True]]
    assert over_capacity(top, w, 4, 1.0, "position").tolist() == [[False, False], [False, False], [True, False],
                                                                  [True, True]]
    assert not over_capacity(top, w, 4, 2.0, "probs").any()  # enough room: dropless


def test_dropped_copies_contribute_nothing():
    c = _config(moe_expert_capacity_factor=0.5)
    layer = _layer(c)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(4))
    y = layer(x)
    (dropped,) = layer.aux_scale.dropped
    assert 0.4 < dropped.item() < 0.6  # half the capacity of a uniform load: about half the copies
    # the same tokens through the dropless layer, with the dropped copies' weights zeroed, agree
    from megazero.model.moe.layer import over_capacity

    logits = x.reshape(-1, H) @ layer.router.weight.t()
    top, weights, _ = route(logits, 2, False)
    keep = ~over_capacity(top, weights, E, 0.5, "probs")
    rows = [sum(weights[t, j] * layer.experts[str(int(top[t, j]))].partial(x.reshape(-1, H)[t:t + 1])[0]
                for j in range(2) if keep[t, j]) for t in range(S * B)]
    want = torch.stack([r if torch.is_tensor(r) else torch.zeros(H) for r in rows]).view(S, B, H)
    torch.testing.assert_close(y, want, atol=1e-5, rtol=1e-5)


def test_sigmoid_group_limited_routing_as_deepseek_v3():
    """Sigmoid scores; 8 experts in 4 groups of 2, a token's 4 experts from its 2 best groups (a group
    scored by the sum of its best 4 / 2 = 2 experts); their sigmoids renormalised and scaled by 2.5."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 8, generator=g, dtype=torch.float64)
    top, w, probs = route(logits, 4, False, "sigmoid", groups=4, group_topk=2, scaling=2.5)
    s = torch.sigmoid(logits)
    for t in range(16):
        group_scores = s[t].view(4, 2).sort(descending=True).values[:, :2].sum(-1)
        allowed = set(group_scores.argsort(descending=True)[:2].tolist())
        cand = [e for e in range(8) if e // 2 in allowed]
        want = sorted(cand, key=lambda e: -s[t, e].item())[:4]
        assert sorted(top[t].tolist()) == sorted(want)
        torch.testing.assert_close(w[t], s[t, top[t]] / s[t, top[t]].sum() * 2.5)
    torch.testing.assert_close(probs.sum(-1), torch.ones(16, dtype=torch.float64))


def test_fp64_router_runs_end_to_end():
    c = _config(moe_router_dtype="fp64", moe_aux_loss_coeff=0.01, moe_router_score_function="sigmoid")
    layer = _layer(c)
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(6), requires_grad=True)
    layer(x).sum().backward()
    (aux,), _, _ = layer.aux_scale.take()
    assert aux.dtype == torch.float64 and layer.router.weight.grad is not None and x.grad is not None


def test_a_layer_built_on_its_own_is_initialised():
    c = _config(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True)
    layer = MoELayer(c, lambda: MLP(c, tp_group=None, tp_size=1, expert=True), tp_group=None, tp_size=1,
                     ep_group=None, ep_size=1, ep_rank=0, aux_scale=AuxLossScale(), init_method=init_methods(c)[0],
                     shared=lambda: MLP(c, tp_group=None, tp_size=1, expert=True, ffn_size=16))
    for name, p in layer.named_parameters():
        assert torch.isfinite(p).all() and p.abs().max() < 1.0, name  # N(0, 0.02), not torch.empty's bytes


def test_expert_bias_chooses_the_experts_but_not_their_weights():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]], dtype=torch.float64)
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    top, w, _ = route(logits, 2, False, "sigmoid", bias=bias)
    assert sorted(top[0].tolist()) == [0, 2]  # expert 2 chosen through its bias ...
    s = torch.sigmoid(logits)[0]
    torch.testing.assert_close(w[0], s[top[0]] / s[top[0]].sum())  # ... weighted by its own score


def test_expert_bias_moves_against_the_load():
    from megazero.model.moe.layer import Router

    c = _config(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    router = Router(c, init_methods(c)[0])
    assert torch.equal(router.expert_bias, torch.zeros(E)) and "expert_bias" in router.state_dict()
    router.update_expert_bias(torch.tensor([8.0, 0, 0, 0, 0, 0, 0, 0]), 0.01)
    assert torch.equal(router.expert_bias, torch.tensor([-0.01] + [0.01] * 7)) and not router.tokens_per_expert.any()


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch build has no torch._grouped_mm")
def test_grouped_matmuls_give_the_loops_bits():
    """--moe-grouped-gemm: the experts' two grouped matmuls against the per-expert loop, forward and
    every gradient bit for bit (fp32)."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(S, B, H, generator=g)
    grad = torch.randn(S, B, H, generator=g)
    runs = []
    for grouped in (False, True):
        layer = _layer(_config(moe_grouped_gemm=grouped))
        xi = x.clone().requires_grad_()
        y = layer(xi)
        y.backward(grad)
        assert layer.experts.grouped(xi.reshape(-1, H)) == grouped
        runs.append((y, xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (y0, dx0, g0), (y1, dx1, g1) = runs
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    for name in g0:
        assert torch.equal(g0[name], g1[name]), name


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch build has no torch._grouped_mm")
def test_grouped_matmuls_keep_no_copy_of_the_weights_for_backward():
    """What autograd saves beside the parameters themselves is the same for the grouped matmuls as for
    the loop: no stacked copy of the experts' weights lives from forward to backward."""
    x = torch.randn(S, B, H, generator=torch.Generator().manual_seed(8), requires_grad=True)
    saved = []
    for grouped in (False, True):
        layer = _layer(_config(moe_grouped_gemm=grouped))
        params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
        sizes = {}

        def pack(t):
            if t.untyped_storage().data_ptr() not in params:
                sizes[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            layer(x).sum().backward()
        saved.append(sum(sizes.values()))
    expert_bytes = sum(p.numel() * p.element_size() for p in layer.experts.parameters())
    assert saved[1] - saved[0] <= 4 * E, (saved, expert_bytes)  # the grouped matmuls' int32 row offsets


def _etp_case(tp: int, etp: int, ep: int, extra: dict):
    """Expert TP other than TP: each rank routes its own (sequence-parallel) tokens and sends them to
    every etp rank of their experts. Against one process on all ranks' tokens in rank order."""
    from megazero import mpu

    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(9)
    x_all = torch.randn(S * world // tp, B, H, generator=g)
    grad_all = torch.randn(x_all.shape, generator=g)
    one = _layer(_config(**extra))  # built before the groups: one process, no TP
    xo = x_all.clone().requires_grad_()
    y_all = one(xo)
    y_all.backward(grad_all)
    groups = mpu.initialize_model_parallel(tp, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)
    c = _config(sequence_parallel=tp > 1, **extra)
    torch.manual_seed(3)
    mine = MoELayer(c, lambda: MLP(c, tp_group=groups.etp_group if etp > 1 else mpu.NO_GROUP, tp_size=etp, expert=True),
                    tp_group=groups.tp_group, tp_size=tp, ep_group=groups.ep_group, ep_size=ep, ep_rank=groups.ep_rank,
                    aux_scale=AuxLossScale(), init_method=init_methods(c)[0], etp_group=groups.etp_group,
                    etp_size=etp, etp_rank=groups.etp_rank, exchange_group=groups.expert_group)
    assert mine.own_tokens
    with torch.no_grad():  # the one process's weights, this rank's shard of each of its experts
        for p, q in zip(mine.router.parameters(), one.router.parameters()):
            p.copy_(q)
        for e, expert in mine.experts.items():
            for p, q in zip(expert.parameters(), one.experts[e].parameters()):
                p.copy_(_shard(q, p, groups.etp_rank, etp))
                assert p.tp_shard == (groups.etp_rank, etp)
    rows = slice(rank * S // tp, (rank + 1) * S // tp)  # global rank = dp rank x tp + tp rank: rank order
    x = x_all[rows].clone().requires_grad_()
    y = mine(x)
    y.backward(grad_all[rows])
    # Bit for bit when each expert is whole and gets every token routed to it (in one process's order);
    # sums over etp shards, or an expert's rows split over ranks (ep 1), round differently.
    atol = 0 if etp == 1 and ep * etp == world else 1e-5
    torch.testing.assert_close(y, y_all[rows].detach(), rtol=0, atol=atol)
    torch.testing.assert_close(x.grad, xo.grad[rows], rtol=0, atol=atol)
    for e, expert in mine.experts.items():
        for (name, p), q in zip(expert.named_parameters(), one.experts[e].parameters()):
            want = _shard(q.grad, p, groups.etp_rank, etp)
            if ep * etp < world:  # the expert's rows are spread over its expert-data-parallel ranks
                dist.all_reduce(p.grad, group=groups.edp_group)
            torch.testing.assert_close(p.grad, want, rtol=0, atol=atol, msg=lambda m: f"expert {e} {name}: {m}")
    tol = 1e-5 if etp > 1 else 1e-6  # the partial sums over etp round differently
    for (name, p), q in zip(mine.router.named_parameters(), one.router.parameters()):
        router = p.grad.clone()  # summed over TP by the layer; over data parallel here
        dist.all_reduce(router, group=groups.dp_group)
        torch.testing.assert_close(router, q.grad, rtol=tol, atol=tol, msg=lambda m: f"router {name}: {m}")


def _shard(full: torch.Tensor, p: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """This etp rank's part of an expert's ``full`` tensor as ``p`` holds it (fc2's bias: whole on every rank)."""
    from megazero.mpu.sharding import shard_of_full

    if not getattr(p, "tensor_model_parallel", False):
        return full
    return shard_of_full(full, p.partition_dim, p.partition_stride, rank, size)


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "gpt_oss"])
@pytest.mark.parametrize("world,tp,etp,ep", [(2, 2, 1, 2), (4, 2, 1, 4), (4, 1, 2, 2), (2, 2, 1, 1)])
def test_expert_tensor_parallelism_other_than_tp_equals_one_process(world, tp, etp, ep, gpt_oss):
    run_distributed(world, _etp_case, tp, etp, ep, GPT_OSS if gpt_oss else {})


def _padded_case(size: int):
    """Padded to capacity at ep ``size`` against one process without padding on every rank's tokens."""
    rank = dist.get_rank()
    kw = dict(moe_expert_capacity_factor=1.0)
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(S, B, H, generator=g) for _ in range(size)]
    grads = [torch.randn(S, B, H, generator=g) for _ in range(size)]
    outs = []
    for r in range(size):  # one process: each rank's micro-batch on its own, not padded
        one = _layer(_config(**kw))
        x = xs[r].clone().requires_grad_()
        y = one(x)
        y.backward(grads[r])
        outs.append((y.detach(), x.grad, {n: p.grad for n, p in one.named_parameters()}))
    mine = _layer(_config(moe_pad_expert_input_to_capacity=True, **kw), dist.group.WORLD, size, rank)
    mine.counter = {}
    x = xs[rank].clone().requires_grad_()
    y = mine(x)
    y.backward(grads[rank])
    torch.testing.assert_close(y, outs[rank][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, outs[rank][1], rtol=1e-5, atol=1e-6)
    for name, p in mine.named_parameters():
        if is_expert_parameter(p):  # an expert's gradient: the sum over every rank's micro-batch
            torch.testing.assert_close(p.grad, sum(o[2][name] for o in outs), rtol=1e-4, atol=1e-5)
    slots = min(math.ceil(S * B * 2 / E), S * B)  # capacity factor 1, top-2
    per_rank = E // size * slots * H * 4
    sent = 2 * (size - 1) * per_rank  # dispatch and combine, to each other rank, whatever the routing
    assert mine.counter == ({"forward": sent, "backward": sent} if size > 1 else {}), mine.counter


@pytest.mark.parametrize("size", [1, 2, 4])
def test_padding_to_capacity_changes_nothing_but_the_bytes(size):
    run_distributed(size, _padded_case, size)


def test_evaluation_takes_its_own_capacity_and_a_minimum_holds():
    """DeepSpeed-MoE's eval capacity factor and min capacity: a factor too small to keep a copy still keeps
    ``moe_min_capacity`` per expert; in evaluation the eval factor (here: room for every copy) applies."""
    from megazero.model.moe.layer import over_capacity

    top = torch.zeros(10, 1, dtype=torch.long)  # every token to expert 0
    assert int((~over_capacity(top, torch.ones(10, 1), 4, 0.01, "position", minimum=3)).sum()) == 3
    g = torch.Generator().manual_seed(6)
    x = torch.randn(S, B, H, generator=g)
    dropless = _layer(_config()).eval()(x)
    layer = _layer(_config(moe_expert_capacity_factor=0.1, moe_eval_capacity_factor=float(E)))
    assert not torch.allclose(layer.train()(x), dropless)  # training: capacity 0.1 drops copies
    torch.testing.assert_close(layer.eval()(x), dropless, rtol=0, atol=0)


def _tp_case(sequence_parallel: bool, gpt_oss: dict):
    """Expert TP = TP 2 (the tokens gathered over TP), with and without sequence parallelism, a gated
    shared expert beside the routed ones: against one process on the same tokens, every gradient."""
    from megazero import mpu
    from megazero.mpu.sharding import shard_of_full

    torch.set_num_threads(1)
    tp, rank = 2, dist.get_rank()
    extra = dict(moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True, **gpt_oss)
    g = torch.Generator().manual_seed(9)
    x_all, grad_all = torch.randn(S, B, H, generator=g), torch.randn(S, B, H, generator=g)
    one = MoELayer(_config(**extra), lambda: MLP(_config(**extra), tp_group=None, tp_size=1, expert=True),
                   tp_group=None, tp_size=1, ep_group=None, ep_size=1, ep_rank=0, aux_scale=AuxLossScale(),
                   init_method=init_methods(_config())[0],
                   shared=lambda: MLP(_config(**extra), tp_group=None, tp_size=1, expert=True, ffn_size=32))
    if gpt_oss:  # every bias nonzero and fc1's outputs past the clamp
        with torch.no_grad():
            for p in one.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    xo = x_all.clone().requires_grad_()
    one(xo).backward(grad_all)
    groups = mpu.initialize_model_parallel(tp)
    c = _config(sequence_parallel=sequence_parallel, **extra)

    def mlp(ffn_size=None):
        return MLP(c, tp_group=groups.tp_group, tp_size=tp, expert=True, **({"ffn_size": ffn_size} if ffn_size else {}))
    mine = MoELayer(c, mlp, tp_group=groups.tp_group, tp_size=tp, ep_group=None, ep_size=1, ep_rank=0,
                    aux_scale=AuxLossScale(), init_method=init_methods(c)[0], shared=lambda: mlp(32),
                    etp_group=groups.tp_group, etp_size=tp, etp_rank=groups.tp_rank)
    params = dict(one.named_parameters())
    with torch.no_grad():  # the one process's weights, this rank's shard of the sharded ones
        for name, p in mine.named_parameters():
            full = params[name]
            p.copy_(shard_of_full(full, p.partition_dim, p.partition_stride, groups.tp_rank, tp)
                    if getattr(p, "tensor_model_parallel", False) else full)
    rows = slice(rank * S // tp, (rank + 1) * S // tp) if sequence_parallel else slice(None)
    x = x_all[rows].clone().requires_grad_()
    y = mine(x)
    y.backward(grad_all[rows])
    tol = dict(rtol=1e-5, atol=1e-5) if gpt_oss else dict(rtol=0, atol=1e-6)  # its weights are 15x larger
    torch.testing.assert_close(y, one(x_all)[rows].detach(), **tol)
    torch.testing.assert_close(x.grad, xo.grad[rows], **tol)
    for name, p in mine.named_parameters():  # the replicated ones (router, gate) whole on every TP rank
        full = params[name].grad
        want = (shard_of_full(full, p.partition_dim, p.partition_stride, groups.tp_rank, tp)
                if getattr(p, "tensor_model_parallel", False) else full)
        torch.testing.assert_close(p.grad, want, rtol=1e-5, atol=1e-5 if gpt_oss else 1e-6,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("gpt_oss", [False, True], ids=["swiglu", "gpt_oss"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_experts_equal_one_process(sequence_parallel, gpt_oss):
    run_distributed(2, _tp_case, sequence_parallel, GPT_OSS if gpt_oss else {})
