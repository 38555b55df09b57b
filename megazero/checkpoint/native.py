"""Training checkpoints: everything needed to continue, written so a crash never corrupts one.

Layout (a shared filesystem, as Megatron assumes)::

    SAVE/latest                        "iter_0000100" — written last, atomically
    SAVE/iter_0000100/config.json      the resolved TrainConfig
    SAVE/iter_0000100/train_state.json iteration, consumed samples, LR schedule
    SAVE/iter_0000100/rng_rank00003.safetensors   every rank's RNG states
    SAVE/iter_0000100/zero_rank00003.safetensors  ZeRO partitions (any-layout reload)
    SAVE/iter_0000100/manifest.json    sha256 of every file above (and of every data chunk of the shards)

A save goes to ``iter_0000100.partial`` (every rank creates it: a shared
filesystem's attribute cache may not show another node's mkdir), every file is
fsync'd, the directory is renamed once every rank has finished and the manifest
is written, and only then does ``latest`` move. A crash or kill during a save
leaves the previous checkpoint and ``latest`` intact.

Loading is parallel: each rank reads only the bytes it will own and verifies
them against the manifest, so a truncated or edited file is refused with its
name without any rank hashing the whole checkpoint. Nothing is unpickled
(safetensors and JSON only). A failure on any rank, in a save or a load, stops
every rank with that rank's message (``failures.agree``).

A full checkpoint, as the converters write (``tools/convert_from_hf.py``,
``tools/convert_from_megatron.py``)::

    OUT/model_full.safetensors  the weights under their tp = 1 names
    OUT/config.json             the GPTConfig
    OUT/tokenizer/              the model's tokenizer, by content (where it has one)

is read as it is wherever a training checkpoint is: a directory with a ``latest``
marker is a training checkpoint, one with only ``model_full.safetensors`` a full one.
``checkpoint_reader.py`` opens either, and Megatron-LM's torch_dist, for the programs that read a model.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from megazero import mpu
from megazero.checkpoint.async_save import HostCopier, PendingSave, finish_write, gather_on_rank0
from megazero.utils.phase_agreement import agree, attempt
from megazero.zero.checkpoint import CheckpointError, publish_loaded_state, read_zero_state
from megazero.zero.engine import ZeroEngine
from megazero.zero.shard_io import digest_file, fsync_path, sha256_file

__all__ = ["CheckpointError", "save_checkpoint", "stage_checkpoint", "PendingSave", "MegazeroSave", "load_checkpoint",
           "latest_iteration", "checkpoint_dir", "clear_partial", "publish_directory",
           "load_full_model", "read_manifest", "resolve_checkpoint_dir", "is_full_checkpoint", "TOKENIZER_DIR",
           "FULL_WEIGHTS"]

LATEST = "latest"
TOKENIZER_DIR = "tokenizer"  # the run's tokenizer, by content (megazero.data.save_tokenizer_files)
FULL_WEIGHTS = "model_full.safetensors"  # a full checkpoint's weights (megazero.model.state_dict.save_full)
MANIFEST_FORMAT = "megazero-manifest-2"


def checkpoint_dir(save: str, iteration: int) -> str:
    return os.path.join(save, f"iter_{iteration:07d}")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


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


def _persistent_buffers(engine: ZeroEngine) -> dict[str, torch.Tensor]:
    """The model's state that is not a parameter (e.g. the routers' expert biases), by global name, on
    the host. Every rank holding a buffer writes it; ranks holding the same one write the same values."""
    return {engine.param_name(name): b.detach().cpu().contiguous() for name, b in _named_persistent_buffers(engine)}


def _named_persistent_buffers(engine: ZeroEngine):
    for prefix, module in engine.module.named_modules():
        for name, b in module.named_buffers(recurse=False):
            if name not in module._non_persistent_buffers_set:
                yield (f"{prefix}.{name}" if prefix else name), b


def _saved_buffers(directory: str, manifest: dict) -> dict[str, torch.Tensor]:
    """Every rank's saved persistent buffers by global name (each file verified against the manifest)."""
    from safetensors.torch import load_file

    saved: dict[str, torch.Tensor] = {}
    for name in sorted(f for f in manifest["files"] if f.startswith("buffers_rank")):
        saved.update(load_file(_verified(directory, manifest, name)))
    return saved


def _restore_buffers(engine: ZeroEngine, directory: str, manifest: dict) -> None:
    """Copy the saved persistent buffers into this rank's (found by global name in any rank's file, so a
    checkpoint resumes at another layout); a buffer the checkpoint lacks is an error."""
    mine = {engine.param_name(n): b for n, b in _named_persistent_buffers(engine)}
    if not mine:
        return
    saved = _saved_buffers(directory, manifest)
    missing = sorted(set(mine) - set(saved))
    if missing:
        raise CheckpointError(f"{directory} lacks the model buffers {missing[:4]}: it was saved by a model without "
                              "them (e.g. without --moe-router-enable-expert-bias); resume with the same model")
    with torch.no_grad():
        for name, b in mine.items():
            b.copy_(saved[name].to(b.device, b.dtype))


def _restore_rng(tensors: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(tensors["cpu"])
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])
    tracker = {k[len("tracker."):]: v for k, v in tensors.items() if k.startswith("tracker.")}
    if tracker:
        mpu.get_rng_tracker().set_states(tracker)


def save_checkpoint(
    save: str, iteration: int, engine: ZeroEngine, *, train_state: dict[str, Any], config: dict[str, Any],
    tokenizer: Optional[Any] = None,
    pipeline=None,
    on_written: Optional[Callable[[str], None]] = None,
) -> str:
    """Collective: write the checkpoint of ``iteration`` and point ``latest`` at it.

    ``tokenizer`` is recorded by content in ``tokenizer/`` (its defining files, listed in the
    manifest like every other file), so the checkpoint does not depend on where they lived.
    ``on_written(partial_directory)`` runs on each rank once its files are written, before the
    commit; an error there fails the save on every rank as a failed write does.

    Every file is fsync'd, then the manifest, then the directory is renamed and the
    parent fsync'd, and only then does ``latest`` move (and get fsync'd): a crash at any
    point leaves the previous checkpoint in force. A failure on any rank stops every
    rank with that rank's message (:class:`RunAborted`). It is :func:`stage_checkpoint`'s
    three parts in a row, over the default group, without host copies.
    """
    pending = stage_checkpoint(save, iteration, engine, train_state=train_state, config=config, tokenizer=tokenizer,
                               pipeline=pipeline, on_written=on_written, copy=False)
    _, failure = attempt(pending.write)
    finish_write(pending, failure)
    return pending.directory


def stage_checkpoint(
    save: str, iteration: int, engine: ZeroEngine, *, train_state: dict[str, Any], config: dict[str, Any],
    tokenizer: Optional[Any] = None, pipeline=None, group: Optional[dist.ProcessGroup] = None,
    on_written: Optional[Callable[[str], None]] = None, copy: bool = True,
) -> "MegazeroSave":
    """Collective over ``group`` (default: the default group): the checkpoint of ``iteration``, staged
    (:mod:`~megazero.checkpoint.async_save`). The stale ``.partial`` directory is removed, and with ``copy``
    the rank's ZeRO partitions, optimizer state, RNG and persistent buffers are copied into host memory
    (``host_bytes``: one copy of what the rank holds), so training may go on while ``write()`` runs;
    without ``copy`` the write reads the live tensors (the synchronous save)."""
    from megazero.zero.checkpoint import stage_zero_state

    final = checkpoint_dir(save, iteration)
    clear_partial(save, final + ".partial", group)
    copier = HostCopier() if copy else None
    host = copier if copier is not None else (lambda t: t.detach().cpu().contiguous())
    zero = stage_zero_state(engine, **_pipeline_kwargs(pipeline), snapshot=copier.float32 if copier else None)
    rng = {k: host(v) for k, v in _rng_tensors().items()}
    buffers = {k: host(v) for k, v in _persistent_buffers(engine).items()}
    if copier is not None:
        copier.finish()
    layout = {"tp_size": engine.tp_size, "dp_size": engine.dp_size, "stage": engine.stage,
              **({"pp_size": pipeline.groups.pp_size} if pipeline is not None else {})}
    coords = {"tp_rank": engine.tp_rank, "dp_rank": engine.dp_rank,
              "pp_rank": _pipeline_kwargs(pipeline).get("pp_rank", 0)}
    pending = MegazeroSave(save, final, zero, rng, buffers, json.loads(json.dumps(train_state)),
                           json.loads(json.dumps(config)), tokenizer=tokenizer, on_written=on_written, group=group,
                           layout=layout, coords=coords,
                           drop_pages=None if copy else engine.drop_pages)  # the write reads the NVMe maps itself
    pending.host_bytes = copier.bytes if copier is not None else 0
    return pending


class MegazeroSave(PendingSave):
    """A staged megazero checkpoint (:func:`stage_checkpoint`): ``write()`` writes this rank's files into
    ``DIR.partial``, ``commit()`` gathers every rank's entries, and rank 0 writes the manifest, renames
    the directory and moves ``latest``."""

    def __init__(self, save: str, final: str, zero: tuple[dict, dict], rng: dict, buffers: dict, train_state: dict,
                 config: dict, *, tokenizer, on_written, group, layout: dict, coords: dict, drop_pages) -> None:
        self.save, self.partial, self.directory = save, final + ".partial", final
        self.zero, self.rng, self.buffers = zero, rng, buffers
        self.train_state, self.config, self.tokenizer = train_state, config, tokenizer
        self.on_written, self.group = on_written, group
        self.layout, self.coords, self.drop_pages = layout, coords, drop_pages
        self.entries: Optional[dict[str, dict]] = None

    def write(self) -> None:
        from safetensors.torch import save_file

        from megazero.zero.checkpoint import write_zero_state

        rank, partial = _rank(), self.partial
        os.makedirs(partial, exist_ok=True)  # every rank: NFS attribute caches may not show rank 0's mkdir
        zero_path = write_zero_state(*self.zero, partial)
        if self.drop_pages is not None:
            self.drop_pages()
        rng_path = os.path.join(partial, f"rng_rank{rank:05d}.safetensors")
        save_file(self.rng, rng_path)
        fsync_path(rng_path)
        paths = [rng_path]
        if self.buffers:
            buffers_path = os.path.join(partial, f"buffers_rank{rank:05d}.safetensors")
            save_file(self.buffers, buffers_path)
            fsync_path(buffers_path)
            paths.append(buffers_path)
        if rank == 0:
            paths += self._write_rank0_files()
        if self.on_written is not None:
            self.on_written(partial)
        entries = {os.path.relpath(p, partial): digest_file(p) for p in [zero_path] + paths}
        entries[os.path.relpath(zero_path, partial)].update(self.coords)
        self.entries = entries
        self.zero = self.rng = self.buffers = None  # the host copies are on disk now

    def _write_rank0_files(self) -> list[str]:
        paths = []
        for name, obj in (("train_state.json", self.train_state), ("config.json", self.config)):
            path = os.path.join(self.partial, name)
            _write_json_atomic(path, obj)
            paths.append(path)
        if self.tokenizer is not None:
            from megazero.data import save_tokenizer_files

            tok_dir = os.path.join(self.partial, TOKENIZER_DIR)
            save_tokenizer_files(self.tokenizer, tok_dir)
            for name in sorted(os.listdir(tok_dir)):
                fsync_path(os.path.join(tok_dir, name))
                paths.append(os.path.join(tok_dir, name))
            fsync_path(tok_dir)
        return paths

    def commit(self) -> None:
        gathered = gather_on_rank0(self.entries, self.group)

        def seal() -> None:
            if gathered is not None:
                manifest = {"format": MANIFEST_FORMAT, "layout": self.layout,
                            "files": {k: v for e in gathered for k, v in e.items()}}
                _commit(self.save, self.partial, self.directory, manifest)

        agree("checkpoint save", seal, group=self.group)


def clear_partial(save: str, partial: str, group: Optional[dist.ProcessGroup] = None) -> None:
    """Collective over ``group``: rank 0 makes ``save`` and removes a stale ``partial`` directory (an
    interrupted save's); also the barrier, so that nobody writes before it is gone."""
    def prepare() -> None:
        if _rank() == 0:
            os.makedirs(save, exist_ok=True)
            shutil.rmtree(partial, ignore_errors=True)

    agree("checkpoint save", prepare, group=group)


def _pipeline_kwargs(pipeline) -> dict[str, Any]:
    """A pipeline stage (``megazero.pipeline.PipelineStage``) records its place; its engine already
    names every parameter as at pp = 1 (``zero.initialize(param_names=...)``)."""
    if pipeline is None or pipeline.groups.pp_size == 1:
        return {}
    return {"pp_rank": pipeline.groups.pp_rank, "pp_size": pipeline.groups.pp_size}


def _commit(save: str, partial: str, final: str, manifest: dict) -> None:
    """Rank 0: seal the checkpoint directory durably, then move ``latest`` (the only visible switch)."""
    _write_json_atomic(os.path.join(partial, "manifest.json"), manifest)
    publish_directory(save, partial, final, LATEST, os.path.basename(final) + "\n")


def publish_directory(save: str, partial: str, final: str, tracker: str, text: str) -> None:
    """Rank 0: rename the written ``partial`` directory to ``final`` durably, then write ``text`` into the
    tracker file ``save/tracker`` atomically (the only visible switch: a crash before it leaves the previous
    checkpoint in force)."""
    fsync_path(partial)
    if os.path.exists(final):
        shutil.rmtree(final)
    os.replace(partial, final)
    fsync_path(save)  # the rename is durable before the tracker points at it
    tmp = os.path.join(save, tracker + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(save, tracker))
    fsync_path(save)


def latest_iteration(load: str) -> Optional[int]:
    """Iteration that ``latest`` points at, or None when the directory has no checkpoint yet."""
    marker = os.path.join(load, LATEST)
    if not os.path.exists(marker):
        return None
    name = open(marker).read().strip()
    if not name.startswith("iter_") or not name[5:].isdigit():
        raise CheckpointError(f"{marker} should name an iter_NNNNNNN directory, found {name!r}")
    return int(name[5:])


def read_manifest(directory: str) -> dict:
    """The manifest of a checkpoint directory, in the current form (older ones: name -> sha256)."""
    path = os.path.join(directory, "manifest.json")
    if not os.path.exists(path):
        raise CheckpointError(f"{directory} has no manifest.json: it is incomplete (a save was interrupted?)")
    try:
        manifest = json.load(open(path))
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}): the checkpoint is damaged; load an earlier "
                              "iteration") from None
    if not isinstance(manifest, dict):
        raise CheckpointError(f"{path} does not hold a megazero manifest")
    if "files" not in manifest:
        manifest = {"files": {k: {"sha256": v} for k, v in manifest.items()}}
    for name, entry in manifest["files"].items():
        p = os.path.join(directory, name)
        if not os.path.exists(p):
            raise CheckpointError(f"checkpoint file {p} is missing")
        if "size" in entry and os.path.getsize(p) != entry["size"]:
            raise CheckpointError(f"checkpoint file {p} does not match its sha256 in manifest.json (size "
                                  f"{os.path.getsize(p)} instead of {entry['size']}): it was truncated or modified; "
                                  "restore it or load an earlier iteration")
    return manifest


def _verified(directory: str, manifest: dict, name: str) -> str:
    """Path of a small file of the checkpoint after checking its whole-file sha256."""
    path = os.path.join(directory, name)
    entry = manifest["files"].get(name)
    if entry is None:
        raise CheckpointError(f"{path} is not listed in {directory}/manifest.json")
    if sha256_file(path) != entry["sha256"]:
        raise CheckpointError(f"checkpoint file {path} does not match its sha256 in manifest.json: "
                              "it was truncated or modified; restore it or load an earlier iteration")
    return path


def load_checkpoint(load: str, engine: ZeroEngine, iteration: Optional[int] = None, *,
                    pipeline=None, load_optimizer: bool = True) -> Optional[dict[str, Any]]:
    """Collective: restore ``engine`` and this rank's RNG; return the saved train state
    (None when ``load`` holds no checkpoint yet, so a fresh run can start).

    Every rank reads (and verifies against the manifest) only the bytes it will own;
    a failure on any rank stops all of them with that rank's message.
    """
    def read() -> Optional[dict[str, Any]]:
        it = latest_iteration(load) if iteration is None else iteration
        if it is None:
            return None
        directory = checkpoint_dir(load, it)
        if not os.path.isdir(directory):
            raise CheckpointError(f"checkpoint directory {directory} does not exist")
        manifest = read_manifest(directory)
        pk = _pipeline_kwargs(pipeline)
        meta = read_zero_state(engine, directory, manifest, load_optimizer=load_optimizer, partial_model=bool(pk))
        world = dist.get_world_size() if dist.is_initialized() else 1
        saved_world = meta["tp_size"] * meta["dp_size"] * meta.get("pp_size", 1)
        same_layout = (saved_world == world and meta["tp_size"] == engine.tp_size
                       and meta.get("pp_size", 1) == pk.get("pp_size", 1))
        rng = None
        rng_name = f"rng_rank{_rank():05d}.safetensors"
        if same_layout and rng_name in manifest["files"]:
            # Same layout: every rank continues its own RNG streams (exact resume). After a
            # reshard the saved streams belong to other ranks; the fresh seeding stands.
            from safetensors.torch import load_file

            rng = load_file(_verified(directory, manifest, rng_name))
        _restore_buffers(engine, directory, manifest)
        state = json.load(open(_verified(directory, manifest, "train_state.json")))
        state["resharded"] = not same_layout
        state["bytes_read"] = meta["bytes_read"]
        return {"state": state, "meta": meta, "rng": rng}

    loaded = agree("checkpoint load", read)
    if loaded is None:
        return None
    note = publish_loaded_state(engine, loaded["meta"])
    if loaded["rng"] is not None:
        _restore_rng(loaded["rng"])
    state = loaded["state"]
    state["scaler_note"] = note
    return state


def load_full_model(load: str, iteration: Optional[int] = None, *, stream: bool = False):
    """``(GPTConfig, full fp32 state dict with tp=1 names, saved TrainConfig dict)`` of a training checkpoint, for
    export and inference at any TP size. ``load`` is the --save directory or one iter_* directory.

    With ``stream=True`` the state dict is an iterator of ``(name, tensor)`` read one tensor at a
    time (peak memory: one full tensor), verified chunk by chunk against the manifest.
    """
    from megazero.model import GPTConfig
    from megazero.zero.checkpoint import iter_full_parameters

    directory = resolve_checkpoint_dir(load, iteration)
    manifest = read_manifest(directory)
    saved = json.load(open(_verified(directory, manifest, "config.json")))
    params = iter_full_parameters(directory, manifest=manifest)
    return GPTConfig.from_dict(saved["model"]), (params if stream else dict(params)), saved


def resolve_checkpoint_dir(load: str, iteration: Optional[int] = None) -> str:
    """``load`` itself when it is an iter_* directory, else the one ``iteration`` (default: latest) names."""
    if os.path.exists(os.path.join(load, "train_state.json")):
        return load
    iteration = iteration if iteration is not None else latest_iteration(load)
    if iteration is None:
        raise CheckpointError(f"{load} holds no checkpoint: no 'latest' marker, no train_state.json, no "
                              f"{FULL_WEIGHTS} and no torch_dist iteration; pass a --save directory of "
                              "pretrain_gpt.py (either --ckpt-format) or Megatron-LM, one of its iter_* directories, "
                              "or the output of tools/convert_from_hf.py")
    return checkpoint_dir(load, iteration)


def is_full_checkpoint(load: str, iteration: Optional[int] = None) -> bool:
    """Whether ``load`` is read as a full checkpoint (``model_full.safetensors`` + ``config.json``, as the
    converters write): it has those and no training checkpoint ('latest' or train_state.json) to prefer."""
    return (iteration is None and os.path.isfile(os.path.join(load, FULL_WEIGHTS))
            and not os.path.exists(os.path.join(load, "train_state.json")) and latest_iteration(load) is None)
