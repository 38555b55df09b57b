"""Parameters ZeRO used to get wrong: frozen ones, ones only some ranks use, weights shared across
units, and bf16 gradients summed over many micro-batches. Each against one-process PyTorch."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import zero
from tests.distributed import run_distributed

LR, WD = 1e-2, 0.1


class Net(torch.nn.Module):
    """embed -> 3 blocks (ZeRO units) -> extra -> tied head. ``mode`` picks the case under test."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode
        self.embed = torch.nn.Embedding(50, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                                              torch.nn.Linear(32, 16)) for _ in range(3))
        self.extra = torch.nn.Linear(32, 16)
        self.extra.bias.requires_grad_(False)  # never used: frozen, or AdamW and ZeRO would disagree on decay
        if mode == "shared":  # a module outside the units uses block 1's second weight
            self.extra.weight = self.blocks[1][2].weight
        else:  # unused here: frozen, so that AdamW and ZeRO agree on it (an unused trainable one gets decay)
            self.extra.requires_grad_(False)
        if mode == "frozen":
            for p in list(self.blocks[0].parameters()) + [self.extra.bias]:
                p.requires_grad_(False)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, ids, labels, skip_block=None):
        x = self.embed(ids)
        for i, block in enumerate(self.blocks):
            if i != skip_block:
                x = x + block(x)
        if self.mode == "shared":
            x = x + F.linear(torch.cat([x, x], -1), self.extra.weight.t().contiguous().t()[:, :16].repeat(1, 2) * 0.5)
        logits = F.linear(self.norm(x), self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 50, (4, 6), generator=g), torch.randint(0, 50, (4, 6), generator=g)


def _skip(mode, rank):
    # "conditional": rank 0 skips block 1, rank 1 skips nothing (a layer used on some ranks only)
    return 1 if mode == "conditional" and rank == 0 else None


def _zero(mode, stage):
    torch.manual_seed(0)
    model = Net(mode)
    cfg = {"train_micro_batch_size_per_gpu": 2,
           "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WD}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0,
                                 "stage3_prefetch_bucket_size": 1}}
    engine = zero.initialize(model, cfg)
    rank = dist.get_rank()
    for step in range(3):
        ids, labels = _data(step)
        loss = engine(ids[rank * 2:rank * 2 + 2], labels[rank * 2:rank * 2 + 2], _skip(mode, rank)).mean()
        engine.backward(loss)
        engine.step()
    return engine.consolidated_state_dict(rank0_only=False)


def _reference(mode):
    torch.manual_seed(0)
    model = Net(mode)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, weight_decay=WD)
    for step in range(3):
        ids, labels = _data(step)
        opt.zero_grad()
        # the DP mean of each rank's loss on its rows, with each rank's own control flow
        loss = sum(model(ids[r * 2:r * 2 + 2], labels[r * 2:r * 2 + 2], _skip(mode, r)).mean() for r in range(2)) / 2
        loss.backward()
        if mode == "conditional":  # AdamW skips grad-less params; ZeRO's zero grad must match that here
            assert model.blocks[1][0].weight.grad is not None
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, model


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("mode", ["frozen", "conditional", "shared"])
def test_matches_single_process_adamw(mode, stage):
    ref, model = _reference(mode)
    for sd in run_distributed(2, _zero, mode, stage):
        for k, v in ref.items():
            torch.testing.assert_close(sd[k], v, atol=1e-5, rtol=1e-5, msg=lambda m: f"{mode} stage {stage} {k}: {m}")
    if mode == "frozen":  # never decayed, never moved
        torch.manual_seed(0)
        init = Net(mode).state_dict()
        for k in ("blocks.0.0.weight", "blocks.0.2.bias", "extra.bias"):
            assert torch.equal(sd[k], init[k]), k


def _bf16_grads(stage, accum_dtype):
    torch.manual_seed(0)
    model = Net("plain")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 32, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "zero_optimization": {"stage": stage}}
    if accum_dtype:
        cfg["data_types"] = {"grad_accum_dtype": accum_dtype}
        cfg["communication_data_type"] = accum_dtype
    engine = zero.initialize(model, cfg)
    rank = dist.get_rank()
    for mb in range(32):
        ids, labels = _data(100 + mb)
        engine.backward(engine(ids[rank * 2:rank * 2 + 2], labels[rank * 2:rank * 2 + 2]).mean())
    # The reduced gradient partitions right before the step, gathered to full groups.
    out = {}
    for g, shard in engine.grad_shard.items():
        full = torch.empty(g.padded_numel, dtype=torch.float32)
        dist.all_gather_into_tensor(full, shard.float().contiguous())
        out.update({k: v.clone() for k, v in g.unflatten(full).items()})
    return out


def test_bf16_gradients_accumulate_in_fp32():
    # Reference: the same bf16 forward/backward per micro-batch and rank, summed in fp64, on one
    # thread like the ranks (LayerNorm's bf16 weight gradient rounds differently per thread split).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Net("plain").to(torch.bfloat16)
    total = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in model.named_parameters() if p.requires_grad}
    for mb in range(32):
        ids, labels = _data(100 + mb)
        for r in range(2):
            model.zero_grad()
            (model(ids[r * 2:r * 2 + 2], labels[r * 2:r * 2 + 2]).mean() / 32).backward()
            for n in total:
                total[n] += model.get_parameter(n).grad.double()
    torch.set_num_threads(threads)
    ours = run_distributed(2, _bf16_grads, 2, None)[0]
    lossy = run_distributed(2, _bf16_grads, 2, "bf16")[0]

    def rel(got):
        num = sum(float((got[n].double() - t).pow(2).sum()) for n, t in total.items())
        return (num / sum(float(t.pow(2).sum()) for t in total.values())) ** 0.5

    # fp32 accumulation and reduction: only fp32 rounding of the sums.
    assert rel(ours) < 1e-5, rel(ours)
    # bf16 accumulation (DeepSpeed's old default) loses far more over 32 micro-batches.
    assert rel(lossy) > 100 * rel(ours), (rel(lossy), rel(ours))
