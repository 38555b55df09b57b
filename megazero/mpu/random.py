"""Model-parallel RNG: dropout that differs across TP ranks and agrees across DP ranks.

Two streams per rank, as in Megatron-LM:

* the default generator, seeded identically on every rank of a model replica's
  TP group (and on all DP replicas), drives everything that must agree across TP:
  weight initialization and dropout on replicated activations;
* the ``model-parallel-rng`` stream of the tracker, seeded with an offset plus
  the TP rank, drives dropout inside TP regions (e.g. on attention scores, whose
  heads differ per rank) so those masks are independent across TP ranks.

Unlike Megatron's ``CudaRNGStatesTracker`` the tracker works on any device: it
forks the generator of the device that runs the computation (CUDA or CPU).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import torch

from . import parallel_state

__all__ = [
    "RNGStatesTracker",
    "get_rng_tracker",
    "get_cuda_rng_tracker",
    "model_parallel_manual_seed",
    "model_parallel_cuda_manual_seed",
    "MODEL_PARALLEL_RNG",
    "checkpoint",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Offset between the default seed and the tensor-parallel seed (Megatron uses the same constant).
_TP_SEED_OFFSET = 2718


def _device_rng_state(device_type: str) -> torch.Tensor:
    return torch.cuda.get_rng_state() if device_type == "cuda" else torch.get_rng_state()


def _set_device_rng_state(device_type: str, state: torch.Tensor) -> None:
    if device_type == "cuda":
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named RNG states that can be forked into the current device generator."""

    def __init__(self) -> None:
        self.states: dict[str, torch.Tensor] = {}
        self.device_type = "cuda" if torch.cuda.is_available() else "cpu"

    def reset(self) -> None:
        self.states = {}

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        if name in self.states:
            raise ValueError(f"RNG state {name!r} already exists; call reset() before seeding again")
        saved = _device_rng_state(self.device_type)
        if self.device_type == "cuda":
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.states[name] = _device_rng_state(self.device_type)
        _set_device_rng_state(self.device_type, saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block with the named state as the device RNG, then store its advance."""
        if name not in self.states:
            raise RuntimeError(
                f"RNG state {name!r} is not set: call megazero.mpu.model_parallel_manual_seed(seed) first"
            )
        saved = _device_rng_state(self.device_type)
        _set_device_rng_state(self.device_type, self.states[name])
        try:
            yield
        finally:
            self.states[name] = _device_rng_state(self.device_type)
            _set_device_rng_state(self.device_type, saved)


# The tracker is process state in the same sense as the groups registry: one per rank.
_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


get_cuda_rng_tracker = get_rng_tracker  # Megatron's name


def model_parallel_manual_seed(seed: int, tp_rank: Optional[int] = None) -> None:
    """Seed the default generators with ``seed`` and the TP stream with ``seed + 2718 + tp_rank``."""
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)


model_parallel_cuda_manual_seed = model_parallel_manual_seed  # Megatron's name


def _rng_snapshot(device_type: str) -> tuple[torch.Tensor, Optional[torch.Tensor], dict[str, torch.Tensor]]:
    cuda_state = torch.cuda.get_rng_state() if device_type == "cuda" else None
    return torch.get_rng_state(), cuda_state, _TRACKER.get_states()


def _rng_restore(snapshot) -> None:
    cpu_state, cuda_state, tracker_states = snapshot
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state)
    _TRACKER.set_states(tracker_states)


class _CheckpointFunction(torch.autograd.Function):
    """Drop activations of ``function`` in forward; recompute them in backward
    under the exact RNG states (default and tracker) that the forward saw."""

    @staticmethod
    def forward(ctx, function, num_tensor_args, *args):
        ctx.function = function
        ctx.rng = _rng_snapshot(_TRACKER.device_type)
        tensor_args = args[:num_tensor_args]
        ctx.other_args = args[num_tensor_args:]
        ctx.save_for_backward(*tensor_args)
        with torch.no_grad():
            return function(*tensor_args, *ctx.other_args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        after_forward = _rng_snapshot(_TRACKER.device_type)
        _rng_restore(ctx.rng)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*inputs, *ctx.other_args)
        finally:
            _rng_restore(after_forward)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(t.grad if t.requires_grad else None for t in inputs)


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Activation checkpoint of ``function(*args)`` that restores the model-parallel RNG.

    Tensor arguments must come first; non-tensor arguments (flags, None) follow.
    """
    n = 0
    while n < len(args) and isinstance(args[n], torch.Tensor):
        n += 1
    if any(isinstance(a, torch.Tensor) for a in args[n:]):
        raise TypeError("checkpoint(): pass tensor arguments before non-tensor ones")
    return _CheckpointFunction.apply(function, n, *args)
