"""Sequence parallelism keeps the sequence shard, not the gathered input, for QKV, FC1 and the LM head."""

import torch
import torch.nn.functional as F

from megazero import mpu
from tests.distributed import run_distributed
from tests.model.common import BATCH, SEQ, batch, tiny_config


def _after_forward_bytes(tp, gathered_inputs_saved):
    import megazero.mpu.layers as layers
    from megazero.model import GPTModel
    from megazero.utils import LiveMemoryTracker

    mpu.initialize_model_parallel(tp)
    config = tiny_config("gpt", sequence_parallel=True)
    torch.manual_seed(0)
    model = GPTModel(config)
    ids, labels = batch(config)
    fn = layers._LinearWithSequenceParallelGather
    if gathered_inputs_saved:  # the previous implementation: autograd all-gather, then F.linear
        fn.apply = staticmethod(lambda x, w, b, g: F.linear(mpu.gather_from_sequence_parallel_region(x, g, True), w, b))
    try:
        with LiveMemoryTracker() as tracker:
            loss = model(ids, labels=labels).mean()
            after_forward = tracker.mark("after_forward", settle=True).current_bytes
            loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    finally:
        if gathered_inputs_saved:
            del fn.apply  # back to torch.autograd.Function.apply
    return after_forward, grads


def test_sequence_parallel_saves_shards_for_qkv_fc1_and_head():
    tp = 2
    new = run_distributed(4, _after_forward_bytes, tp, False)
    old = run_distributed(4, _after_forward_bytes, tp, True)
    config = tiny_config("gpt")
    gathered = SEQ * BATCH * config.hidden_size * 4
    shard = gathered // tp
    per_model = 2 * config.num_layers + 1  # QKV and FC1 of every layer, and the tied LM head
    for (new_bytes, new_grads), (old_bytes, old_grads) in zip(new, old):
        assert old_bytes - new_bytes == per_model * (gathered - shard), (old_bytes, new_bytes)
        for name, g in new_grads.items():
            torch.testing.assert_close(g, old_grads[name], atol=1e-6, rtol=1e-6, msg=lambda m: f"{name}: {m}")
