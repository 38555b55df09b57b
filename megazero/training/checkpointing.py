"""Training checkpoints: everything needed to continue, written so a crash never corrupts one.

Layout (a shared filesystem, as Megatron assumes)::

    SAVE/latest                        "iter_0000100" — written last, atomically
    SAVE/iter_0000100/config.json      the resolved TrainConfig
    SAVE/iter_0000100/train_state.json iteration, consumed samples, LR schedule
    SAVE/iter_0000100/rng_rank00003.safetensors   every rank's RNG states
    SAVE/iter_0000100/zero_rank00003.safetensors  ZeRO partitions (any-layout reload)
    SAVE/iter_0000100/manifest.json    sha256 of every file above

A save goes to ``iter_0000100.partial`` and is renamed when every rank has
finished and the manifest is written; only then does ``latest`` move. A crash
or kill during a save leaves the previous checkpoint and ``latest`` intact.
Loading checks the manifest first, so a truncated or edited file is refused
with its name; nothing is unpickled (safetensors and JSON only).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from typing import Any, Optional

import torch
import torch.distributed as dist

from .. import mpu
from ..zero.checkpoint import CheckpointError, load_zero_state, save_zero_state
from ..zero.engine import ZeroEngine

__all__ = ["CheckpointError", "save_checkpoint", "load_checkpoint", "latest_iteration", "checkpoint_dir", "load_full_model"]

LATEST = "latest"


def checkpoint_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _write_json_atomic(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["cuda"] = torch.cuda.get_rng_state()
    for name, state in mpu.get_rng_tracker().get_states().items():
        out[f"tracker.{name}"] = state
    return out


def _restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["cpu"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    tracker = {k[len("tracker."):]: v for k, v in tensors.items() if k.startswith("tracker.")}
    if tracker:
        mpu.get_rng_tracker().set_states(tracker)


def save_checkpoint(
    save: str, iteration: int, engine: ZeroEngine, *, train_state: dict[str, Any], config: dict[str, Any]
) -> str:
    """Collective: write the checkpoint of ``iteration`` and point ``latest`` at it."""
    from safetensors.torch import save_file

    final = checkpoint_dir(save, iteration)
    partial = final + ".partial"
    if _rank() == 0:
        os.makedirs(save, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    _barrier()
    rank = _rank()
    paths = [save_zero_state(engine, partial)]
    rng_path = os.path.join(partial, f"rng_rank{rank:05d}.safetensors")
    save_file({k: v.contiguous() for k, v in _rng_tensors().items()}, rng_path)
    paths.append(rng_path)
    if rank == 0:
        for name, obj in (("train_state.json", train_state), ("config.json", config)):
            path = os.path.join(partial, name)
            _write_json_atomic(path, obj)
            paths.append(path)
    hashes = {os.path.basename(p): _sha256(p) for p in paths}
    gathered: list[Optional[dict]] = [None] * (dist.get_world_size() if dist.is_initialized() else 1)
    if dist.is_initialized():
        dist.all_gather_object(gathered, hashes)
    else:
        gathered = [hashes]
    if rank == 0:
        manifest = {k: v for h in gathered for k, v in h.items()}
        _commit(save, partial, final, iteration, manifest)
    _barrier()
    return final


def _commit(save: str, partial: str, final: str, iteration: int, manifest: dict[str, str]) -> None:
    """Rank 0: seal the checkpoint directory, then move ``latest`` (the only visible switch)."""
    _write_json_atomic(os.path.join(partial, "manifest.json"), manifest)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(partial, final)
    tmp = os.path.join(save, LATEST + ".tmp")
    with open(tmp, "w") as f:
        f.write(os.path.basename(final) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save, LATEST))


def latest_iteration(load: str) -> Optional[int]:
    """Iteration that ``latest`` points at, or None when the directory has no checkpoint yet."""
    marker = os.path.join(load, LATEST)
    if not os.path.exists(marker):
        return None
    name = open(marker).read().strip()
    if not name.startswith("iter_") or not name[5:].isdigit():
        raise CheckpointError(f"{marker} should name an iter_NNNNNNN directory, found {name!r}")
    return int(name[5:])


def _verify(directory: str) -> None:
    manifest_path = os.path.join(directory, "manifest.json")
    if not os.path.exists(manifest_path):
        raise CheckpointError(f"{directory} has no manifest.json: it is incomplete (a save was interrupted?)")
    manifest = json.load(open(manifest_path))
    for name, digest in manifest.items():
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise CheckpointError(f"checkpoint file {path} is missing")
        if _sha256(path) != digest:
            raise CheckpointError(f"checkpoint file {path} does not match its sha256 in manifest.json: "
                                  "it was truncated or modified; restore it or load an earlier iteration")


def load_checkpoint(load: str, engine: ZeroEngine, iteration: Optional[int] = None) -> Optional[dict[str, Any]]:
    """Collective: restore ``engine`` and this rank's RNG; return the saved train state
    (None when ``load`` holds no checkpoint yet, so a fresh run can start)."""
    if iteration is None:
        iteration = latest_iteration(load)
        if iteration is None:
            return None
    directory = checkpoint_dir(load, iteration)
    if not os.path.isdir(directory):
        raise CheckpointError(f"checkpoint directory {directory} does not exist")
    # Rank 0 checks every file once; everyone raises the same error.
    error = [None]
    if _rank() == 0:
        try:
            _verify(directory)
        except CheckpointError as e:
            error[0] = str(e)
    if dist.is_initialized():
        dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise CheckpointError(error[0])
    meta = load_zero_state(engine, directory)
    rng_path = os.path.join(directory, f"rng_rank{_rank():05d}.safetensors")
    world = dist.get_world_size() if dist.is_initialized() else 1
    saved_world = meta["tp_size"] * meta["dp_size"]
    if os.path.exists(rng_path) and saved_world == world and meta["tp_size"] == engine.tp_size:
        # Same layout: every rank continues its own RNG streams (exact resume). After a
        # reshard the saved streams belong to other ranks; the fresh seeding stands.
        from safetensors.torch import load_file

        _restore_rng(load_file(rng_path))
    state = json.load(open(os.path.join(directory, "train_state.json")))
    state["resharded"] = saved_world != world or meta["tp_size"] != engine.tp_size
    return state


def load_full_model(load: str, iteration: Optional[int] = None):
    """``(GPTConfig, full fp32 state dict with tp=1 names, saved TrainConfig dict)`` of a training checkpoint, for
    export and inference at any TP size. ``load`` is the --save directory or one iter_* directory."""
    from ..model import GPTConfig
    from ..zero.checkpoint import read_full_parameters

    if os.path.exists(os.path.join(load, "train_state.json")):
        directory = load
    else:
        iteration = iteration if iteration is not None else latest_iteration(load)
        if iteration is None:
            raise CheckpointError(f"{load} holds no checkpoint ('latest' is missing); pass an iter_* directory")
        directory = checkpoint_dir(load, iteration)
    _verify(directory)
    saved = json.load(open(os.path.join(directory, "config.json")))
    return GPTConfig.from_dict(saved["model"]), read_full_parameters(directory), saved
