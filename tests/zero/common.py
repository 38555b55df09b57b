"""A tiny GPT, its data, and the single-process AdamW reference the ZeRO runs must reproduce."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from megazero import mpu, zero
from megazero.model import GPTConfig, GPTModel

SEED = 1234
GLOBAL_MICRO_ROWS = 8  # rows of one global micro-batch, split over the DP ranks
SEQ = 16
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.95), 1e-8, 0.1


def tiny_config(**overrides) -> GPTConfig:
    kw = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=120, seq_length=SEQ,
              max_position_embeddings=SEQ, hidden_dropout=0.0, attention_dropout=0.0,
              make_vocab_size_divisible_by=32, attention_backend="math")
    kw.update(overrides)
    return GPTConfig(**kw)


def batches(steps: int, accum: int, global_micro_rows: int, vocab: int = 120) -> torch.Tensor:
    """Token batches ``[steps, accum, rows, seq + 1]``, identical on every rank."""
    g = torch.Generator().manual_seed(99)
    return torch.randint(0, vocab, (steps, accum, global_micro_rows, SEQ + 1), generator=g)


def ds_config(stage: int, accum: int = 1, clip: float = 0.0, threshold: int = 0, micro: int = 2, **extra) -> dict:
    cfg = {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS, "weight_decay": WD}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": threshold},
        "gradient_clipping": clip,
    }
    cfg.update(extra)
    return cfg


def zero_run(tp: int, stage: int, steps: int = 5, accum: int = 1, clip: float = 0.0, meta: bool = False,
             threshold: int = 0, model_overrides: dict | None = None, extra: dict | None = None,
             after: Callable[[zero.ZeroEngine], object] | None = None, config=None):
    """Train on this rank's slice of every global micro-batch; return losses, norms, weights
    (and ``after(engine)`` once the last step is done, when given)."""
    mpu.initialize_model_parallel(tp)
    dp, dp_rank = mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()
    cfg = tiny_config(**(model_overrides or {}))
    torch.manual_seed(SEED)
    model = GPTModel(cfg, device="meta" if meta else None)
    micro = GLOBAL_MICRO_ROWS // dp
    engine = zero.initialize(model, config or ds_config(stage, accum, clip, threshold, micro, **(extra or {})), mpu=mpu)
    data = batches(steps, accum, GLOBAL_MICRO_ROWS)
    losses, norms = [], []
    for step in range(steps):
        total = torch.zeros(1)
        for a in range(accum):
            rows = data[step, a, dp_rank * micro:(dp_rank + 1) * micro]
            loss = engine(rows[:, :-1], labels=rows[:, 1:]).mean()
            engine.backward(loss)
            engine.step()
            total += loss.detach() / accum
        dist.all_reduce(total, group=mpu.get_data_parallel_group())
        losses.append(float(total) / dp)
        norms.append(engine.get_global_grad_norm())
    if after is not None:
        return losses, norms, engine.consolidated_state_dict(), after(engine)
    return losses, norms, engine.consolidated_state_dict()


def reference_run(steps: int = 5, accum: int = 1, clip: float = 0.0, model_overrides: dict | None = None,
                  make_step: Callable[[GPTModel], Callable[[], None]] | None = None):
    """The same training in one process on the full batch: torch.optim.AdamW, or the update
    ``make_step(model)`` returns (called after the clip; it zeroes nothing)."""
    cfg = tiny_config(**(model_overrides or {}))
    torch.manual_seed(SEED)
    model = GPTModel(cfg)
    if make_step is None:
        opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
        make_step = lambda m: opt.step  # noqa: E731
    update = make_step(model)
    data = batches(steps, accum, GLOBAL_MICRO_ROWS)
    losses, norms = [], []
    for step in range(steps):
        model.zero_grad()
        total = 0.0
        for a in range(accum):
            rows = data[step, a]
            loss = model(rows[:, :-1], labels=rows[:, 1:]).mean() / accum
            loss.backward()
            total += loss.item()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip > 0 else float("inf"))
        update()
        losses.append(total)
        norms.append(float(norm))
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
