"""TP-invariant initialization of sharded weights, drawn slice by slice.

Megatron's init methods (N(0, std), the scaled N(0, std/sqrt(2L)) of output
layers, zeros, ones) are described by an :class:`InitSpec`. Normal values come
from a counter-based generator (:mod:`counter_rng`) keyed by the parameter's
name and one base seed taken from the default generator, so any slice of the
full (tp=1) tensor can be drawn without the rest: a TP rank draws its shard, a
ZeRO rank its partition of it (``megazero.zero.materialize``), and the gathered
weights are bit-identical at any tp x dp x stage.

A layer built outside :func:`reset_parameters_in_order` (no names known) keys
each weight by a number drawn from the default generator instead, which is
equally TP-invariant. An init method that is not one of Megatron's falls back to
drawing the full tensor from the default generator and keeping this rank's shard.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from typing import Callable, Iterator, Optional

import torch

from .counter_rng import FLAT_CHUNK, chunk_width, normal_at, param_key

InitMethod = Callable[[torch.Tensor], torch.Tensor]

__all__ = [
    "InitMethod",
    "init_method_normal",
    "scaled_init_method_normal",
    "init_method_zeros",
    "set_tensor_model_parallel_attributes",
    "copy_tensor_model_parallel_attributes",
    "initialize_sharded_",
    "NormalInit",
    "InitSpec",
    "recording_init_specs",
    "parameter_naming",
    "modules_with_direct_parameters",
    "reset_parameters_in_order",
]


@dataclasses.dataclass(frozen=True)
class NormalInit:
    """N(0, std). Called on a plain tensor it draws from the default generator, like
    ``torch.nn.init.normal_``; through :func:`initialize_sharded_` it is counter-based."""

    std: float

    def __call__(self, t: torch.Tensor) -> torch.Tensor:
        return torch.nn.init.normal_(t, mean=0.0, std=self.std)


def init_method_normal(std: float) -> InitMethod:
    """N(0, std) initialization."""
    return NormalInit(std)


def scaled_init_method_normal(std: float, num_layers: int) -> InitMethod:
    """N(0, std / sqrt(2 * num_layers)): GPT-2's scaling for residual-output projections."""
    return init_method_normal(std / math.sqrt(2.0 * num_layers))


def init_method_zeros(t: torch.Tensor) -> torch.Tensor:
    return torch.nn.init.zeros_(t)


def set_tensor_model_parallel_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """Megatron's markers: which parameters are TP shards, and along which dim."""
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim
    param.partition_stride = stride


def copy_tensor_model_parallel_attributes(dst: torch.Tensor, src: torch.Tensor) -> None:
    for name in ("tensor_model_parallel", "partition_dim", "partition_stride", "sequence_parallel", "shared_embedding"):
        if hasattr(src, name):
            setattr(dst, name, getattr(src, name))


@dataclasses.dataclass(frozen=True)
class InitSpec:
    """How to produce any slice of a parameter's TP shard: ``kind`` is ``normal`` (N(mean, std)),
    ``fill`` (a constant ``value``) or ``custom`` (``init_method`` on the full tensor)."""

    kind: str
    full_shape: tuple[int, ...]
    partition_dim: int = 0
    stride: int = 1
    rank: int = 0
    world: int = 1
    std: float = 0.0
    mean: float = 0.0
    value: float = 0.0
    init_method: Optional[InitMethod] = None

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        shape[self.partition_dim] //= self.world
        return tuple(shape)

    def full_ranges(self, lo: int, hi: int) -> list[tuple[int, int]]:
        """Elements ``[lo, hi)`` of the flattened local shard as contiguous ranges of the full
        (tp=1) flat tensor. A unit of ``blk * B`` local elements (one block of the partition
        dim, see ``mpu.sharding``) maps to one contiguous full range."""
        if self.world == 1 or hi <= lo:
            return [(lo, hi)] if hi > lo else []
        shape, d = self.full_shape, self.partition_dim
        s_, b_ = shape[d], math.prod(shape[d + 1:])
        blk = s_ // (self.stride * self.world)
        unit = blk * b_
        out = []
        for u in range(lo // unit, (hi - 1) // unit + 1):
            a, s = divmod(u, self.stride)
            start = (a * s_ + (s * self.world + self.rank) * blk) * b_
            x, y = max(lo, u * unit), min(hi, (u + 1) * unit)
            out.append((start + x - u * unit, start + y - u * unit))
        return out

    def draw(self, key: Optional[int], lo: int, hi: int) -> torch.Tensor:
        """Elements ``[lo, hi)`` of the flattened local shard, fp32 on the CPU."""
        if self.kind == "fill":
            return torch.full((hi - lo,), self.value, dtype=torch.float32)
        if self.kind == "normal":
            numel = math.prod(self.full_shape)
            if len(self.full_shape) >= 2 and self.partition_dim == len(self.full_shape) - 1:
                cols = self.full_shape[-1]
                return normal_at(key, cols, chunk_width(cols), self.full_ranges(lo, hi), self.std, self.mean)
            return normal_at(key, numel, FLAT_CHUNK, self.full_ranges(lo, hi), self.std, self.mean)
        from .sharding import shard_of_full

        master = torch.empty(self.full_shape, dtype=torch.float32)
        self.init_method(master)
        local = shard_of_full(master, self.partition_dim, self.stride, self.rank, self.world) if self.world > 1 else master
        return local.reshape(-1)[lo:hi].clone()


# While set, initialize_sharded_ records specs (param id -> InitSpec) instead of drawing.
_RECORDING: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("megazero_init_recording", default=None)
# While set: {"names": {param id: name}, "base": Optional[int]} for name-keyed draws.
_NAMING: contextvars.ContextVar[Optional[dict]] = contextvars.ContextVar("megazero_init_naming", default=None)


@contextlib.contextmanager
def recording_init_specs(specs: dict) -> Iterator[dict]:
    token = _RECORDING.set(specs)
    try:
        yield specs
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def parameter_naming(names: dict[int, str]) -> Iterator[dict]:
    """Key counter-based draws by parameter name; the base seed is taken from the default
    generator at the first draw (so models without normal init consume nothing extra)."""
    state = {"names": names, "base": None}
    token = _NAMING.set(state)
    try:
        yield state
    finally:
        _NAMING.reset(token)


def _draw_seed() -> int:
    return int(torch.randint(0, 2**62, (1,)).item())


def naming_key(state: dict, name: str) -> int:
    if state["base"] is None:
        state["base"] = _draw_seed()
    return param_key(state["base"], name)


def param_draw_key(param: torch.Tensor) -> int:
    """The counter-generator key of ``param``: by name inside :func:`parameter_naming`, else a
    number from the default generator (the same on every rank seeded alike)."""
    naming = _NAMING.get()
    if naming is not None and id(param) in naming["names"]:
        return naming_key(naming, naming["names"][id(param)])
    return param_key(_draw_seed(), "")


def spec_for(full_shape, partition_dim: int, rank: int, world: int, init_method: InitMethod, stride: int = 1) -> InitSpec:
    common = dict(full_shape=tuple(full_shape), partition_dim=partition_dim, stride=stride, rank=rank, world=world)
    if isinstance(init_method, NormalInit):
        return InitSpec("normal", std=init_method.std, **common)
    if init_method is init_method_zeros:
        return InitSpec("fill", value=0.0, **common)
    return InitSpec("custom", init_method=init_method, **common)


@torch.no_grad()
def initialize_sharded_(
    param: torch.Tensor,
    full_shape: tuple[int, ...],
    partition_dim: int,
    rank: int,
    world_size: int,
    init_method: InitMethod,
    stride: int = 1,
) -> torch.Tensor:
    """Fill ``param`` with this rank's shard (``stride`` blocks per rank, see ``mpu.sharding``)
    of a full weight, drawing only the shard's values."""
    spec = spec_for(full_shape, partition_dim, rank, world_size, init_method, stride)
    recording = _RECORDING.get()
    if recording is not None:
        recording[id(param)] = spec
        return param
    key = param_draw_key(param) if spec.kind == "normal" else None
    values = spec.draw(key, 0, param.numel())
    param.copy_(values.view(param.shape).to(dtype=param.dtype, device=param.device))
    return param


def modules_with_direct_parameters(module: torch.nn.Module) -> list[torch.nn.Module]:
    """Submodules (pre-order) that own parameters themselves rather than through children."""
    return [m for m in module.modules() if any(True for _ in m.parameters(recurse=False))]


@torch.no_grad()
def reset_parameters_in_order(module: torch.nn.Module) -> None:
    """Initialize a model by calling ``reset_parameters()`` of every module that owns
    parameters, in ``module.modules()`` order, from the default generator.

    This order is the contract between a model and partitioned construction: a
    model built on the meta device and materialized one partition at a time
    (``megazero.zero``) gets exactly the same numbers as one built whole. Normal
    weights are keyed by their names in ``module``.
    """
    names: dict[int, str] = {}
    for n, p in module.named_parameters():
        names.setdefault(id(p), n)
    with parameter_naming(names):
        for m in modules_with_direct_parameters(module):
            reset = getattr(m, "reset_parameters", None)
            if reset is None:
                raise TypeError(
                    f"{type(m).__name__} owns parameters but has no reset_parameters(); "
                    "give it one that initializes its own (non-child) parameters"
                )
            reset()
