"""The engine trains any nn.Module: plain torch layers, a tied weight across units, unused parameters."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megazero import zero


class PlainNet(torch.nn.Module):
    """Embedding -> blocks of nn.Linear (a ModuleList: ZeRO-3 units) -> head tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 16)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(),
                                                              torch.nn.Linear(32, 16)) for _ in range(3))
        self.norm = torch.nn.LayerNorm(16)
        self.unused = torch.nn.Linear(4, 4)  # never called: its (absent) gradient must not stall ZeRO

    def forward(self, ids, labels):
        x = self.embed(ids)
        for block in self.blocks:
            x = x + block(x)
        logits = F.linear(self.norm(x), self.embed.weight)
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")


def _data(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 50, (8, 6), generator=g), torch.randint(0, 50, (8, 6), generator=g)


def _zero(stage):
    torch.manual_seed(0)
    model = PlainNet()
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}},
           "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    engine = zero.initialize(model, cfg)  # no mpu: every rank is a data-parallel peer
    rank, losses = dist.get_rank(), []
    for step in range(4):
        ids, labels = _data(step)
        loss = engine(ids[rank * 2:rank * 2 + 2], labels[rank * 2:rank * 2 + 2]).mean()
        engine.backward(loss)
        engine.step()
        t = loss.detach().clone()
        dist.all_reduce(t)
        losses.append(float(t) / 4)
    return losses, engine.consolidated_state_dict()


@pytest.mark.parametrize("stage", [2, 3])
def test_plain_torch_module_matches_single_process(stage):
    from tests.distributed import run_distributed

    torch.manual_seed(0)
    ref = PlainNet()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
    ref_losses = []
    for step in range(4):
        ids, labels = _data(step)
        opt.zero_grad()
        loss = ref(ids, labels).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
        opt.step()
        ref_losses.append(loss.item())
    losses, sd = run_distributed(4, _zero, stage)[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), atol=1e-5, rtol=1e-5)
    for k, v in ref.state_dict().items():
        if k.startswith("unused."):
            # torch skips a parameter whose grad is None; a flat ZeRO partition (DeepSpeed's
            # too) sees a zero gradient instead, so only decoupled weight decay moves it.
            v = v * (1 - 1e-2 * 0.1) ** 4
        torch.testing.assert_close(sd[k], v, atol=1e-6, rtol=1e-5, msg=lambda m: f"{k}: {m}")
