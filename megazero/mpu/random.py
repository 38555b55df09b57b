"""Model-parallel RNG: dropout that differs across TP ranks and agrees across DP ranks.

Two streams per rank, as in Megatron-LM:

* the default generator, seeded identically on every rank of a model replica's
  TP group (and on all DP replicas), drives everything that must agree across TP:
  weight initialization and dropout on replicated activations;
* the ``model-parallel-rng`` stream of the tracker, seeded with an offset plus
  the TP rank, drives dropout inside TP regions (e.g. on attention scores, whose
  heads differ per rank) so those masks are independent across TP ranks.

Unlike Megatron's ``CudaRNGStatesTracker`` the tracker works on any device: it
forks the generator of the device that runs the computation (CUDA or CPU), decided
at fork time (the tensors' device, else ``get_device()``), not at import.
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


def _run_device(device=None) -> torch.device:
    """The device whose generator drives ``device``'s random ops (default: this rank's compute
    device, ``parallel_state.get_device()``): a CUDA device, or the CPU for every other type."""
    device = torch.device(device) if device is not None else parallel_state.get_device()
    return device if device.type == "cuda" else torch.device("cpu")


def _device_rng_state(device: torch.device) -> torch.Tensor:
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def _set_device_rng_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


def _seeded_state(device: torch.device, seed: int) -> torch.Tensor:
    """The state of ``device``'s generator seeded with ``seed``; the live generators are untouched."""
    return torch.Generator(device=device).manual_seed(seed).get_state()


class RNGStatesTracker:
    """Named RNG states that can be forked into the generator of the device that computes.

    A fork drives the generator of ``device`` (the tensors' device), by default the run's
    (``parallel_state.get_device()`` at fork time), so CPU and CUDA runs in one process both
    work. States are kept per device type: a stream continues on the device type it was
    forked on, and starts from its seed the first time it is forked on another one.
    ``get_states``/``set_states`` (checkpoints) carry the states of :attr:`device_type`, the
    device type the streams were seeded for (the run's).
    """

    def __init__(self) -> None:
        self.seeds: dict[str, int] = {}
        self._states: dict[str, dict[str, torch.Tensor]] = {}  # device type -> name -> state
        self.device_type: Optional[str] = None

    @property
    def states(self) -> dict[str, torch.Tensor]:
        return self._states.setdefault(self.device_type or _run_device().type, {})

    def reset(self) -> None:
        self.seeds, self._states, self.device_type = {}, {}, None

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self.states.clear()
        self.states.update({k: v.clone() for k, v in states.items()})

    def add(self, name: str, seed: int, device=None) -> None:
        if name in self.seeds or name in self.states:
            raise ValueError(f"RNG state {name!r} already exists; call reset() before seeding again")
        dev = _run_device(device)
        self.device_type = dev.type
        self.seeds[name] = seed
        self._states.setdefault(dev.type, {})[name] = _seeded_state(dev, seed)

    def _state_for(self, name: str, dev: torch.device) -> dict[str, torch.Tensor]:
        states = self._states.setdefault(dev.type, {})
        if name not in states:
            if name not in self.seeds:
                raise RuntimeError(
                    f"RNG state {name!r} is not set: call megazero.mpu.model_parallel_manual_seed(seed) first"
                )
            states[name] = _seeded_state(dev, self.seeds[name])
        return states

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG, device=None) -> Iterator[None]:
        """Run the block with the named state as ``device``'s RNG (default: the run's device),
        then store its advance."""
        dev = _run_device(device)
        states = self._state_for(name, dev)
        saved = _device_rng_state(dev)
        _set_device_rng_state(dev, states[name])
        try:
            yield
        finally:
            states[name] = _device_rng_state(dev)
            _set_device_rng_state(dev, saved)

    def _snapshot(self) -> dict[str, dict[str, torch.Tensor]]:
        return {t: {k: v.clone() for k, v in st.items()} for t, st in self._states.items()}

    def _restore(self, snapshot: dict[str, dict[str, torch.Tensor]]) -> None:
        self._states = {t: {k: v.clone() for k, v in st.items()} for t, st in snapshot.items()}


def get_rng_tracker() -> RNGStatesTracker:
    """This process's tracker, one per rank, held by mpu's registry (``parallel_state``)."""
    return parallel_state.rng_tracker(RNGStatesTracker)


get_cuda_rng_tracker = get_rng_tracker  # Megatron's name


def model_parallel_manual_seed(seed: int, tp_rank: Optional[int] = None) -> None:
    """Seed the default generators with ``seed`` and the TP stream with ``seed + 2718 + tp_rank``."""
    if tp_rank is None:
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed(seed)
    tracker = get_rng_tracker()
    tracker.reset()
    tracker.add(MODEL_PARALLEL_RNG, seed + _TP_SEED_OFFSET + tp_rank)


model_parallel_cuda_manual_seed = model_parallel_manual_seed  # Megatron's name


def _rng_snapshot() -> tuple[torch.Tensor, Optional[torch.Tensor], dict]:
    # The CUDA generator matters wherever CUDA is in use, whatever the run's device.
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return torch.get_rng_state(), torch.cuda.get_rng_state() if cuda else None, get_rng_tracker()._snapshot()


def _rng_restore(snapshot) -> None:
    cpu_state, cuda_state, tracker_states = snapshot
    torch.set_rng_state(cpu_state)
    if cuda_state is not None:
        torch.cuda.set_rng_state(cuda_state)
    get_rng_tracker()._restore(tracker_states)


class _CheckpointFunction(torch.autograd.Function):
    """Drop activations of ``function`` in forward; recompute them in backward
    under the exact RNG states (default and tracker) that the forward saw."""

    @staticmethod
    def forward(ctx, function, num_tensor_args, *args):
        ctx.function = function
        ctx.rng = _rng_snapshot()
        tensor_args = args[:num_tensor_args]
        ctx.other_args = args[num_tensor_args:]
        ctx.save_for_backward(*tensor_args)
        with torch.no_grad():
            return function(*tensor_args, *ctx.other_args)

    @staticmethod
    def backward(ctx, *grads):
        inputs = [t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors]
        after_forward = _rng_snapshot()
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
