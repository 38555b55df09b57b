"""Muon's per-matrix step inside the ZeRO engine, at every layout.

The update (:class:`megazero.zero.optimizers.muon.MuonConfig` states it) splits into an elementwise
part, run by each rank on the partition of the flat groups it holds as ZeRO keeps them, and one
that needs the whole matrix:

1. each holder folds its reduced, unscaled and clipped gradient into the momentum (the state
   ``momentum_buffer``, partitioned like the fp32 master: checkpoints reshard it like Adam's
   moments) and forms ``u`` (Nesterov or plain);
2. ``u`` goes to the matrix's owner (:mod:`megazero.zero.matrix_exchange`); with
   ``tp_mode="duplicated"`` the owners on each TP rank gather the TP shards (one all-gather per
   matrix, one at a time), so every owner sees the matrix of a tp = 1 run (``distributed``: they run
   the iteration on their blocks together instead);
3. the owner runs Newton-Schulz once per matrix per step (Q, K and V apart with ``split_qkv``),
   scales it, and keeps its TP block;
4. the update goes back to the holders, which apply decoupled weight decay and the update to
   their fp32 master partition; the engine then publishes the parameters as for any optimizer.

The engine calls :meth:`MuonStep.step` at the accumulation boundary only, after the overflow
check: a skipped step leaves the momentum as it was.
"""

from __future__ import annotations

import contextlib
import logging
import math
from typing import Callable, Iterator, Optional

import torch
import torch.distributed as dist

from megazero.mpu.sharding import full_from_shards, is_tp_sharded, shard_of_full, tp_shard_group_of, tp_shard_of
from megazero.zero.comm import CommCounter
from megazero.zero.flat import FlatGroup
from megazero.zero.matrix_exchange import Matrix, MatrixExchange, assign_owners, ns_cost

__all__ = ["newton_schulz", "scale_factor", "MuonStep"]
logger = logging.getLogger(__name__)


def newton_schulz(u: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float,
                  dtype: torch.dtype) -> torch.Tensor:
    """``torch.optim.Muon``'s quintic Newton-Schulz iteration on a 2-D ``u``, in ``dtype`` (the
    same operations in the same order: bf16 equals it bit for bit). ``u`` is left unchanged."""
    a, b, c = coefficients
    x = u.to(dtype, copy=True)
    tall = u.size(0) > u.size(1)
    if tall:
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(steps):
        gram = x @ x.T
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, poly, x, beta=a)
    return x.T if tall else x


def newton_schulz_sharded(u: torch.Tensor, dim: int, all_reduce: Callable[[torch.Tensor], None],
                          coefficients: tuple[float, float, float], steps: int, eps: float,
                          dtype: torch.dtype) -> torch.Tensor:
    """:func:`newton_schulz` of a matrix split over TP ranks along ``dim`` (each holds ``u``, its block),
    without gathering it (Megatron's ``distributed`` TP mode): the Gram matrix of the dimension that is
    not split is summed over the ranks (``all_reduce``, in fp32) and each rank updates its own block,
    using ``(aI + bA + cA^2) X = X (aI + bG + cG^2)`` with ``A = X X^T``, ``G = X^T X`` for row blocks.
    The same map as on the whole matrix; the sums run in another order."""
    a, b, c = coefficients
    x = u.to(dtype, copy=True)
    sq = x.float().pow(2).sum().reshape(1)
    all_reduce(sq)
    x.div_(sq.sqrt().clamp(min=eps).to(dtype))
    for _ in range(steps):
        gram = x.float().T @ x.float() if dim == 0 else x.float() @ x.float().T
        all_reduce(gram)
        gram = gram.to(dtype)
        poly = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, x, poly, beta=a) if dim == 0 else torch.addmm(x, poly, x, beta=a)
    return x


def scale_factor(rows: int, cols: int, mode: str) -> float:
    """The update's scale for a ``rows x cols`` (out x in) matrix (``MuonConfig.scale_mode``)."""
    if mode == "shape_scaling":
        return math.sqrt(max(1.0, rows / cols))
    if mode == "spectral":
        return math.sqrt(max(rows, cols))
    return math.sqrt(rows / cols)  # unit_rms_norm


@contextlib.contextmanager
def _matmul_precision(precision: str) -> Iterator[None]:
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(before)


class MuonStep:
    """The per-matrix groups of one engine and their step (see the module docstring).

    ``groups``: the trainable ``per_matrix`` flat groups; ``tp_group``/``tp_rank``/``tp_size``: the
    engine's TP coordinates (a parameter with its own ``tp_shard_group`` uses that). ``comm`` counts
    the exchanges under each partitioning's name and the TP exchanges under ``muon.tp<i>``."""

    def __init__(self, groups: list[FlatGroup], config: "MuonConfig", comm: CommCounter,
                 tp_group: Optional[dist.ProcessGroup], tp_rank: int, tp_size: int) -> None:
        self.groups, self.config, self.comm = groups, config, comm
        self.tp_group, self.tp_rank, self.tp_size = tp_group, tp_rank, tp_size
        self.dtype = torch.bfloat16 if config.ns_dtype == "bf16" else torch.float32
        self.ns_runs = 0  # Newton-Schulz runs on this rank (each matrix once per step, by its owner)
        self.exchanges: list[MatrixExchange] = []
        self.loads: dict[str, list[float]] = {}
        by_part: dict[str, list[Matrix]] = {}
        for g in groups:
            for s in g.slots:
                by_part.setdefault(g.part.name, []).append(Matrix(g, s, self._whole_shape(s.param)))
        for name, matrices in by_part.items():
            part = matrices[0].group.part
            self.loads[name] = assign_owners(matrices, part.size, config.ns_steps)
            self.exchanges.append(MatrixExchange(matrices, comm, name, part.rank, part.size))
        self._tp_names: dict[Optional[dist.ProcessGroup], str] = {}
        # Each group's matrices with the range of this rank's partition they cover, and each matrix's
        # update scale (1 where the owner scales the parts of a fused matrix itself).
        self.held: dict[FlatGroup, list[tuple[Matrix, tuple[int, int]]]] = {g: [] for g in groups}
        self.scales: dict[Matrix, float] = {}
        for ex in self.exchanges:
            for m in ex.matrices:
                _, s0, n = m.group.owned_range(m.slot)
                if n:
                    self.held[m.group].append((m, (s0, n)))
                self.scales[m] = 1.0 if self._fused(m) else self._scale(*m.shape)  # (a TP shard's with blockwise)

    # ------------------------------------------------------------------ layout

    def _sharded(self, p: torch.nn.Parameter) -> bool:
        """Whether ``p``'s TP shards are gathered whole before Newton-Schulz."""
        return self.config.tp_mode != "blockwise" and is_tp_sharded(p) and self._tp_world(p)[1] > 1

    def _tp_world(self, p: torch.nn.Parameter) -> tuple[int, int]:
        return tp_shard_of(p, self.tp_rank, self.tp_size)

    def _whole_shape(self, p: torch.nn.Parameter) -> tuple[int, int]:
        rows, cols = int(p.shape[0]), int(p.shape[1])
        if self._sharded(p):
            world = self._tp_world(p)[1]
            if int(getattr(p, "partition_dim", 0)) == 0:
                rows *= world
            else:
                cols *= world
        return rows, cols

    def _tp_name(self, group: Optional[dist.ProcessGroup]) -> str:
        if group not in self._tp_names:
            name = f"muon.tp{len(self._tp_names)}"
            self.comm.groups[name] = group
            self._tp_names[group] = name
        return self._tp_names[group]

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, grads: dict[FlatGroup, torch.Tensor], coef: float, optimizer: torch.optim.Optimizer) -> None:
        """Update every per-matrix group's master from its reduced gradient ``grads[g]`` times
        ``coef`` (unscale and clip); the momentum lives in ``optimizer.state[g.master]``."""
        cfg = self.config
        u, scratch = {}, {}
        for g in self.groups:
            state = optimizer.state[g.master]
            buf = state.get("momentum_buffer")
            if buf is None:
                buf = state["momentum_buffer"] = torch.zeros_like(g.master)
            grad = grads[g].float().mul_(coef)
            buf.lerp_(grad, 1 - cfg.momentum)
            u[g] = grad.lerp_(buf, cfg.momentum) if cfg.nesterov else buf
            scratch[g] = grad  # free once u has gone to the owners: the updates come back into it
        for exchange in self.exchanges:
            owned = exchange.gather(u)
            updates = {}
            with _matmul_precision(cfg.fp32_matmul_precision):
                for m in list(owned):  # one whole matrix at a time, each input freed once used
                    flat = owned.pop(m)
                    x = flat.view(m.slot.shape) if self._split_over_tp(m) else self._whole(m, flat)
                    updates[m] = self._update(m, x)
            for g in {m.group for m in exchange.matrices}:
                scratch[g].zero_()
            exchange.scatter(updates, scratch)
        hp = {p: pg for pg in optimizer.param_groups for p in pg["params"]}
        for g in self.groups:
            group = hp[g.master]
            lr, wd = group["lr"], group["weight_decay"]
            if wd:
                g.master.mul_(1 - lr * wd)
            for m, (lo, n) in self.held[g]:  # torch.optim.Muon's form: W - (lr * scale) * O
                g.master.narrow(0, lo, n).add_(scratch[g].narrow(0, lo, n), alpha=-lr * self.scales[m])

    def _whole(self, m: Matrix, flat: torch.Tensor) -> torch.Tensor:
        """``m`` as a 2-D tensor of its whole shape from this rank's ``flat`` part: a TP-sharded matrix
        gathered over its TP group (whose ranks own the same matrices, in the same order)."""
        p = m.slot.param
        if not self._sharded(p):
            return flat.view(m.slot.shape)
        group = tp_shard_group_of(p, self.tp_group)
        world = self._tp_world(p)[1]
        gathered = torch.empty(world * flat.numel(), dtype=flat.dtype, device=flat.device)
        self.comm.all_gather(gathered, flat, self._tp_name(group))
        dim, stride = int(getattr(p, "partition_dim", 0)), int(getattr(p, "partition_stride", 1))
        if dim == 0 and stride == 1:  # the shards stacked are the whole matrix: no copy
            return gathered.view(m.shape)
        shards = gathered.view(world, *m.slot.shape)
        return full_from_shards(list(shards.unbind(0)), dim, stride)

    def _split_over_tp(self, m: Matrix) -> bool:
        """Whether ``m``'s Newton-Schulz runs on its TP blocks together (``tp_mode="distributed"``)."""
        return self.config.tp_mode == "distributed" and self._sharded(m.slot.param)

    def _update(self, m: Matrix, whole: torch.Tensor) -> torch.Tensor:
        """The scaled, orthogonalised update of ``m`` (flat, fp32), this TP rank's block of it. ``whole``
        is the whole matrix, or this rank's TP block when the iteration runs split over TP."""
        p = m.slot.param
        fused = self._fused(m)
        if fused:  # rows repeat per query group as (q, k, v): orthogonalise Q, K and V apart, each scaled
            rows, cols = whole.shape
            groups = rows // sum(fused)
            parts = torch.split(whole.reshape(groups, sum(fused), cols), list(fused), dim=1)
            update = torch.cat([self._orthogonalize(m, t.reshape(-1, cols), scaled=True).view(groups, -1, cols)
                                for t in parts], dim=1).view(rows, cols)
        else:  # scaled by the holders (self.scales), as torch.optim.Muon scales the lr
            update = self._orthogonalize(m, whole, scaled=False)
        self.ns_runs += 1
        if self._sharded(p) and not self._split_over_tp(m):
            rank, world = self._tp_world(p)
            update = shard_of_full(update, int(getattr(p, "partition_dim", 0)),
                                   int(getattr(p, "partition_stride", 1)), rank, world)
        return update.reshape(-1)

    def _orthogonalize(self, m: Matrix, x: torch.Tensor, scaled: bool) -> torch.Tensor:
        """Newton-Schulz of ``x`` (``m``'s whole matrix, a part of it, or their TP blocks), fp32, scaled by
        its whole shape's factor when ``scaled``."""
        cfg = self.config
        rows, cols = x.shape
        if self._split_over_tp(m):
            p = m.slot.param
            dim, world = int(getattr(p, "partition_dim", 0)), self._tp_world(p)[1]
            name = self._tp_name(tp_shard_group_of(p, self.tp_group))
            o = newton_schulz_sharded(x, dim, lambda t: self.comm.all_reduce(t, name), cfg.ns_coefficients,
                                      cfg.ns_steps, cfg.eps, self.dtype).float()
            rows, cols = (rows * world, cols) if dim == 0 else (rows, cols * world)
        else:
            o = newton_schulz(x, cfg.ns_coefficients, cfg.ns_steps, cfg.eps, self.dtype).float()
        scale = self._scale(rows, cols) if scaled else 1.0
        return o if scale == 1.0 else o.mul_(scale)

    def _scale(self, rows: int, cols: int) -> float:
        return scale_factor(rows, cols, self.config.scale_mode) * self.config.extra_scale_factor

    def _fused(self, m: Matrix) -> Optional[tuple[int, ...]]:
        """The per-query-group row blocks of a fused QKV weight when Q, K and V are orthogonalised apart."""
        return getattr(m.slot.param, "fused_matrices", None) if self.config.split_qkv else None

    # ------------------------------------------------------------------ accounting

    def describe(self) -> str:
        """One line: matrices, owners' balance and bytes sent per step on this rank."""
        parts = []
        for ex in self.exchanges:
            loads = self.loads[ex.name]
            balance = max(loads) / (sum(loads) / len(loads)) if sum(loads) else 1.0
            parts.append(f"{len(ex.matrices)} matrices over {ex.name} ({ex.size} ranks; this rank owns "
                         f"{len(ex.owned)}, busiest/mean Newton-Schulz work {balance:.2f})")
        sent = self.bytes_per_step()
        return (f"{'; '.join(parts)}; per step this rank runs {self.ns_flops() / 1e12:.3g} TFLOP of "
                f"Newton-Schulz and sends {sent['in'] / 2**20:.1f} MiB to owners, {sent['out'] / 2**20:.1f} MiB "
                f"back, {sent['tp'] / 2**20:.1f} MiB over TP")

    def ns_flops(self) -> float:
        """FLOPs of the Newton-Schulz iterations this rank runs per step (Q, K and V apart where split)."""
        total = 0.0
        for ex in self.exchanges:
            for m in ex.owned:
                fused = self._fused(m)
                rows, cols = m.shape
                shapes = [(rows // sum(fused) * f, cols) for f in fused] if fused else [m.shape]
                if self._split_over_tp(m):  # each TP rank: its block's Gram and update, the small polynomial
                    dim, world = int(getattr(m.slot.param, "partition_dim", 0)), self._tp_world(m.slot.param)[1]
                    for r, c in shapes:
                        big, k = (r, c) if dim == 0 else (c, r)
                        total += self.config.ns_steps * 2 * (2 * big * k * k / world + 2 * k ** 3)
                else:
                    total += sum(2 * ns_cost(shape, self.config.ns_steps) for shape in shapes)
        return total

    def bytes_per_step(self) -> dict[str, int]:
        """fp32 bytes this rank sends per step: to the owners (``in``), back to the holders
        (``out``), and in the owners' TP gathers or Gram all-reduces (``tp``)."""
        out = {"in": 0, "out": 0, "tp": 0}
        for ex in self.exchanges:
            for k, v in ex.bytes_per_step().items():
                out[k] += v
            for m in ex.owned:
                if self._split_over_tp(m):  # a ring all-reduce sends about twice the Gram matrix per iteration
                    rows, cols = m.slot.shape
                    k = cols if int(getattr(m.slot.param, "partition_dim", 0)) == 0 else rows
                    out["tp"] += 4 * 2 * k * k * self.config.ns_steps
                elif self._sharded(m.slot.param):
                    out["tp"] += 4 * m.slot.numel * (self._tp_world(m.slot.param)[1] - 1)
        return out
