"""Sharded initialization: a ZeRO-3 rank draws only its partition, and the weights equal tp=1's."""

import pytest
import torch

import megazero.mpu.initializers as initializers
from megazero import mpu, zero
from megazero.model import GPTModel
from tests.distributed import run_distributed
from tests.zero.common import ds_config, tiny_config

ARCHS = {"gpt": dict(vocab_size=117), "llama": dict(vocab_size=117, activation="swiglu", normalization="rmsnorm",
                                                   position_embedding_type="rope", add_bias_linear=False,
                                                   tie_embeddings=False),
         # gpt-oss's MLP and router: biases everywhere, the router's drawn like its weight
         "gpt_oss": dict(vocab_size=117, activation="quick_geglu", glu_linear_offset=1.0,
                         activation_func_clamp_value=7.0, num_experts=4, moe_ffn_hidden_size=32, moe_router_bias=True)}


def _init(tp, stage, arch):
    mpu.initialize_model_parallel(tp)
    drawn = [0]
    original = initializers.normal_at

    def counting(key, cols, w, ranges, std, mean=0.0):
        drawn[0] += sum(b - a for a, b in ranges)
        return original(key, cols, w, ranges, std, mean)

    initializers.normal_at = counting
    try:
        torch.manual_seed(31)
        micro = 8 // mpu.get_data_parallel_world_size()
        engine = zero.initialize(GPTModel(tiny_config(**ARCHS[arch]), device="meta"), ds_config(stage, micro=micro),
                                 mpu=mpu)
    finally:
        initializers.normal_at = original
    return engine.consolidated_state_dict(), drawn[0]


@pytest.mark.parametrize("arch", ["gpt", "llama", "gpt_oss"])
def test_tp2_dp2_zero3_weights_equal_the_tp1_model(arch):
    torch.manual_seed(31)
    ref = GPTModel(tiny_config(**ARCHS[arch]))
    out = run_distributed(4, _init, 2, 3, arch)
    sd = out[0][0]
    for n, p in ref.named_parameters():
        torch.testing.assert_close(sd[n], p.detach(), atol=0, rtol=0, msg=lambda m: f"{n}: {m}")
    # Each normal-initialized element was drawn exactly once per TP rank that holds it (TP-replicated
    # ones, the learned positions, by both): nobody drew the whole model.
    drawn = [(n, p) for n, p in ref.named_parameters() if p.dim() == 2 or n.endswith("router.bias")]
    normal = sum(p.numel() for _, p in drawn)
    held = sum(p.numel() * (1 if getattr(p, "tensor_model_parallel", False) else 2) for _, p in drawn)
    assert sum(d for _, d in out) == held
    assert max(d for _, d in out) < 0.4 * normal


def test_zero1_at_tp4_matches_too():
    torch.manual_seed(31)
    ref = GPTModel(tiny_config(**ARCHS["llama"]))
    sd = run_distributed(4, _init, 4, 1, "llama")[0][0]
    for n, p in ref.named_parameters():
        torch.testing.assert_close(sd[n], p.detach(), atol=0, rtol=0, msg=lambda m: f"{n}: {m}")
