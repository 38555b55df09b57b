"""The Mamba-2 mixer against transformers' NemotronHMamba2Mixer (its torch path), and against itself at TP=2 (with
and without sequence parallelism), with packed documents and under context parallelism (state passing)."""

import pytest
import torch
import torch.distributed as dist

from megazero import mpu
from megazero.model import GPTConfig, GPTModel
from megazero.model.attention.cp.context import ContextParallel
from megazero.model.attention.cp.layout import zigzag_layout
from megazero.model.forward_context import ForwardContext
from megazero.model.gpt import materialize_
from megazero.model.recurrent.mamba import MambaMixer
from megazero.model.state_dict import gather_full_state_dict, gather_full_tensor
from tests.distributed import run_distributed
from tests.helpers import randn

HIDDEN, HEADS, HEAD_DIM, GROUPS, STATE, K, CHUNK = 32, 4, 16, 2, 8, 4, 16
SEED = 7


def _config(**kw) -> GPTConfig:
    fields = dict(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, vocab_size=64, hybrid_layer_pattern="M",
                  mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM, mamba_num_groups=GROUPS, mamba_state_dim=STATE,
                  linear_conv_kernel_dim=K, add_bias_linear=False, normalization="rmsnorm", layernorm_epsilon=1e-5,
                  hidden_dropout=0.0, attention_dropout=0.0)
    return GPTConfig(**{**fields, **kw})


def _mixer(config: GPTConfig, tp_group=None, tp_size: int = 1) -> MambaMixer:
    """Built on meta and initialised by name, as GPTModel does (the draws keyed by the parameters' names)."""
    m = MambaMixer(config, tp_group=tp_group, tp_size=tp_size, device="meta", chunk_size=CHUNK)
    materialize_(m, "cpu")
    torch.manual_seed(SEED)
    mpu.reset_parameters_in_order(m)
    return m


def _starts(lengths, batch: int) -> torch.Tensor:
    """[batch, sum(lengths)] bool: True where a document begins."""
    starts = torch.zeros(sum(lengths), dtype=torch.bool)
    starts[torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)[:-1]))] = True
    return starts.expand(batch, -1).clone()


# ---- (a) transformers' NemotronHMamba2Mixer ------------------------------------------------------------------------

def _hf_mixer():
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHMamba2Mixer

    cfg = NemotronHConfig(hidden_size=HIDDEN, mamba_num_heads=HEADS, mamba_head_dim=HEAD_DIM, n_groups=GROUPS,
                          ssm_state_size=STATE, chunk_size=CHUNK, conv_kernel=K, layer_norm_epsilon=1e-5,
                          use_bias=False, use_conv_bias=True, layer_types=["linear_attention"], vocab_size=64)
    torch.manual_seed(0)
    hf = NemotronHMamba2Mixer(cfg, layer_idx=0).eval()
    with torch.no_grad():  # away from the defaults (A = 1..H, D = 1, norm 1), so every parameter matters
        hf.A_log.copy_(torch.log(torch.empty(HEADS).uniform_(1, 16)))
        hf.dt_bias.copy_(torch.randn(HEADS) - 3)
        hf.D.copy_(torch.randn(HEADS))
        hf.norm.weight.copy_(1 + 0.3 * torch.randn(HEADS * HEAD_DIM))
        hf.in_proj.weight.normal_(0, 0.2)
        hf.out_proj.weight.normal_(0, 0.2)
    return hf


def _load_hf(ours: MambaMixer, hf) -> None:
    """transformers' ``in_proj`` is ``[z; x; B; C; dt]`` fused; its ``conv1d.weight`` is ``[C, 1, K]``."""
    d, gn = HEADS * HEAD_DIM, GROUPS * STATE
    z_x, b_c, dt = hf.in_proj.weight.split([2 * d, 2 * gn, HEADS])
    with torch.no_grad():
        ours.in_proj_zx.weight.copy_(z_x)
        ours.in_proj_bc.weight.copy_(b_c)
        ours.in_proj_dt.weight.copy_(dt)
        ours.out_proj.weight.copy_(hf.out_proj.weight)
        ours.conv_weight.copy_(hf.conv1d.weight.squeeze(1))
        ours.conv_bias.copy_(hf.conv1d.bias)
        for name in ("A_log", "D", "dt_bias"):
            getattr(ours, name).copy_(getattr(hf, name))
        ours.norm_weight.copy_(hf.norm.weight)


def test_the_mixer_equals_transformers_nemotron_h():
    hf = _hf_mixer()
    ours = _mixer(_config())
    _load_hf(ours, hf)
    x = randn(2, 70, HIDDEN, seed=1)  # [b, T, h], T spans five chunks of 16, the last one partial
    with torch.no_grad():
        expected = hf(x)
        got = ours(x.transpose(0, 1)).transpose(0, 1)
    assert expected.abs().max() > 0.1
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_initialisation():
    """Megatron's: A in [1, 16], softplus(dt_bias) in [dt_min, dt_max], the convolution in +-1/sqrt(K), D and the
    norm 1; reset_parameters touches only the mixer's own parameters."""
    m = _mixer(_config(mamba_num_heads=64, mamba_head_dim=4, mamba_num_groups=2))
    A = torch.exp(m.A_log)
    assert 1 <= A.min() and A.max() <= 16 and A.max() - A.min() > 10
    dt = torch.nn.functional.softplus(m.dt_bias)
    assert 1e-3 * (1 - 1e-5) <= dt.min() and dt.max() <= 0.1 * (1 + 1e-5) and dt.max() / dt.min() > 20
    bound = 1 / K ** 0.5
    assert m.conv_weight.abs().max() <= bound and m.conv_weight.std() > 0.8 * bound / 3 ** 0.5
    assert m.conv_bias.abs().max() <= bound and torch.equal(m.D, torch.ones(64))
    assert torch.equal(m.norm_weight, torch.ones(256))
    before = {n: p.clone() for n, p in m.named_parameters()}
    with torch.no_grad():
        m.A_log.zero_()
    m.reset_parameters()
    for n, p in m.named_parameters():
        if "." in n:  # a projection's: it initialises itself
            assert torch.equal(p, before[n]), n
    assert (m.A_log > 0).all()


# ---- (c) packed documents ------------------------------------------------------------------------------------------

def test_a_document_does_not_see_the_one_before_it():
    m = _mixer(_config())
    docs = [23, 30, 17]  # starts inside chunks of 16
    x = randn(70, 2, HIDDEN, seed=2)
    context = ForwardContext(starts=_starts(docs, 2))
    with torch.no_grad():
        y = m(x, context)
        x2 = x.clone()
        x2[23:53] += randn(30, 2, HIDDEN, seed=3)  # document 1 (0-based) changed
        y2 = m(x2, context)
        alone = m(x[53:])  # the last document by itself
    assert not torch.equal(y[23:53], y2[23:53])
    assert torch.equal(y[53:], y2[53:])  # exactly: no state, no convolution tap crosses the start
    assert torch.equal(y[:23], y2[:23])
    torch.testing.assert_close(y[53:], alone, rtol=1e-5, atol=1e-6)


# ---- (b) tensor parallelism ----------------------------------------------------------------------------------------

def _run(m: MambaMixer, x: torch.Tensor, context: ForwardContext):
    """Output, input gradient and parameter gradients of ``sum(m(x) * w)`` (a fixed random ``w``)."""
    x = x.detach().requires_grad_(True)
    y = m(x, context)
    (y * randn(*y.shape, seed=11)).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in m.named_parameters()}


def _tensor_parallel(sequence_parallel: bool):
    tp = dist.get_world_size()
    rank = dist.get_rank()
    x = randn(70, 2, HIDDEN, seed=4)
    context = ForwardContext(starts=_starts([30, 40], 2))
    cfg = _config(sequence_parallel=sequence_parallel)
    ref = _mixer(_config())
    ref_w = gather_full_state_dict(ref)
    y_ref, gx_ref, g_ref = _run(ref, x, context)

    mpu.initialize_model_parallel(tp)
    group = mpu.get_tensor_model_parallel_group()
    m = _mixer(cfg, group, tp)
    w = gather_full_state_dict(m)
    assert w.keys() == ref_w.keys()
    for k in w:
        assert torch.equal(w[k], ref_w[k]), f"initial {k} differs at tp={tp}"
    for p in (m.conv_weight, m.A_log, m.norm_weight):
        assert p.sequence_parallel
    rows = slice(rank * 35, (rank + 1) * 35) if sequence_parallel else slice(None)  # SP: a sequence shard
    x_local = x[rows].detach().requires_grad_(True)
    y = m(x_local, context)
    (y * randn(70, 2, HIDDEN, seed=11)[rows]).sum().backward()
    grads = {n: gather_full_tensor(p.grad, p, group) for n, p in m.named_parameters()}
    return rows, y.detach(), x_local.grad, grads, y_ref, gx_ref, g_ref


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tensor_parallel_equals_one_rank(sequence_parallel):
    for rows, y, gx, grads, y_ref, gx_ref, g_ref in run_distributed(2, _tensor_parallel, sequence_parallel):
        torch.testing.assert_close(y, y_ref[rows], rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gx, gx_ref[rows], rtol=1e-5, atol=1e-6)
        assert grads.keys() == g_ref.keys()
        for n, g in grads.items():
            torch.testing.assert_close(g, g_ref[n], rtol=1e-5, atol=1e-6, msg=lambda s: f"grad of {n}: {s}")


# ---- (d) context parallelism ---------------------------------------------------------------------------------------

CP_T = 72  # zigzag chunks of 18 at cp=2: runs [0, 18) + [54, 72) and [18, 36) + [36, 54) (merged), off the 16-grid
CP_DOCS = [25, 31, 16]  # the cut at 36 inside document 1; document 2 starts inside rank 1's run


def _context_parallel(documents: bool):
    rank, cp = dist.get_rank(), dist.get_world_size()
    x = randn(CP_T, 2, HIDDEN, seed=5)
    starts = _starts(CP_DOCS, 2) if documents else None
    weights = randn(CP_T, 2, HIDDEN, seed=12)
    ref = _mixer(_config())
    xr = x.clone().requires_grad_(True)
    y_ref = ref(xr, ForwardContext(starts=starts))
    (y_ref * weights).sum().backward()

    m = _mixer(_config())
    layout = zigzag_layout(CP_T, cp)
    pos = layout.positions(rank)
    ctx = ContextParallel.from_layout(layout, rank, None, "a2a")
    x_local = x[pos].clone().requires_grad_(True)
    y = m(x_local, ForwardContext(cp=ctx, starts=None if starts is None else starts[:, pos]))
    (y * weights[pos]).sum().backward()
    grads = {}
    for n, p in m.named_parameters():
        dist.all_reduce(p.grad)  # ZeRO's reduction over data x context parallel
        grads[n] = p.grad
    return (pos, y.detach(), x_local.grad, grads, y_ref.detach(), xr.grad,
            {n: p.grad for n, p in ref.named_parameters()})


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest difference relative to the largest magnitude of ``b`` (sums over ranks round differently)."""
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("documents", [False, True])
def test_context_parallel_equals_one_rank(documents):
    for pos, y, gx, grads, y_ref, gx_ref, g_ref in run_distributed(2, _context_parallel, documents):
        assert _relative(y, y_ref[pos]) < 1e-6
        assert _relative(gx, gx_ref[pos]) < 1e-6
        assert grads.keys() == g_ref.keys()
        for n, g in grads.items():  # measured <= 1.1e-6: the per-rank partial sums, then the all-reduce
            assert _relative(g, g_ref[n]) < 5e-6, n


# ---- partitioned construction ---------------------------------------------------------------------------------------

def _zero3_weights(tp: int):
    from megazero import zero
    from tests.zero.common import ds_config

    mpu.initialize_model_parallel(tp)
    torch.manual_seed(31)
    model = GPTModel(_hybrid(), device="meta")
    engine = zero.initialize(model, ds_config(3, micro=8 // mpu.get_data_parallel_world_size()), mpu=mpu)
    return engine.consolidated_state_dict()


def _hybrid() -> GPTConfig:
    return _config(num_layers=3, hybrid_layer_pattern="M*-", position_embedding_type="rope", seq_length=16,
                   max_position_embeddings=16)


@pytest.mark.parametrize("tp", [1, 2])
def test_zero3_built_from_meta_draws_the_weights_of_the_whole_model(tp):
    """ZeRO-3 materialises a meta model module by module (the mixer's draws are not capturable, so it is reset
    whole, by name): the weights equal the model built in one piece, at tp=2 (dp=1) and dp=2 (tp=1)."""
    torch.manual_seed(31)
    ref = GPTModel(_hybrid())
    sd = run_distributed(2, _zero3_weights, tp)[0]
    for n, p in ref.named_parameters():
        assert torch.equal(sd[n], p.detach()), n
