"""The planner's time model prices the attention kernel a launch takes: torch's fused kernels with
Megatron's dropout at every cp (the default), the explicit formula's tiles when attention dropout is
keyed by position (--dropout-rng position), at cp 1 as at cp 2. Which kernel a launch takes is checked
against the rehearsal in tests/training/test_cp_dropout_tools.py."""

from __future__ import annotations

from megazero.observe.plan_devices import Cluster, device_preset
from megazero.observe.plan_search import evaluate
from megazero.observe.plan_time import Layout, attention_kernel
from megazero.observe.planner import plan_of
from megazero.config.arguments import parse_args

MODEL = ["--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "8192",
         "--max-position-embeddings", "8192", "--vocab-size", "32000", "--bf16", "--global-batch-size", "16"]


def _plan(cp: int, *extra: str):
    config = parse_args(MODEL + list(extra), 1, check_files=False, planning=True)
    lay = Layout(tp=1, pp=1, dp=8 // cp, cp=cp, zero_stage=1, micro_batch_size=1)
    plan = evaluate(config.model, lay, Cluster(8, 8, device_preset("h100-80gb")), plan_of(config),
                    global_batch_size=16, precision="bf16", optimizer="adamw")
    return attention_kernel(config.model, plan_of(config)["flash_attn"]), plan.time.terms


def test_megatrons_default_dropout_is_priced_as_the_fused_kernel_at_every_cp():
    for cp in (1, 2):
        kernel, terms = _plan(cp)
        assert kernel == "flash"
        assert terms["compute"] == _plan(cp, "--attention-dropout", "0")[1]["compute"]  # dropout inside the kernel


def test_dropout_keyed_by_position_is_priced_as_the_tiles_at_every_cp():
    for cp in (1, 2):
        kernel, keyed = _plan(cp, "--dropout-rng", "position")
        _, fused = _plan(cp)
        assert kernel == "keyed"
        # fp32 GEMMs over the causal half and the masks' hash through HBM: several times the fused step's
        # compute at 8K tokens, where attention is about a third of it; nothing else changes
        assert keyed["compute"] > 3 * fused["compute"], (keyed, fused)
        assert {k: v for k, v in keyed.items() if k != "compute"} == {k: v for k, v in fused.items() if k != "compute"}
    assert _plan(2, "--dropout-rng", "position", "--attention-dropout", "0")[0] == "flash"  # no attention dropout
