"""Recognize checkpoints written by Megatron-LM or Megatron-DeepSpeed, and read them safely.

``detect_foreign_checkpoint(path)`` tells a ``--load`` directory that megazero cannot
resume (instead of silently "starting from scratch") and says how to convert it; Megatron-LM's
``torch_dist`` directories are read as they are (``megazero.checkpoint.torch_dist``), so they pass.
``import_megatron(path)`` reads a Megatron checkpoint's weights (any tp, any pp) into a full
megazero state dict; the name and shape mapping is ``megazero.model.interop.megatron_import``'s.
Every Megatron ``.pt`` file is read with :func:`~megazero.checkpoint.megatron_pickle.load_megatron_file`
(an allow-list; no code from the checkpoint runs).

Layouts read (any tp, any pp):

* Megatron-LM legacy: ``DIR/latest_checkpointed_iteration.txt`` and
  ``DIR/iter_0000100/mp_rank_{tp:02d}[_{pp:03d}]/model_optim_rng.pt`` holding ``args`` and
  ``model['language_model']`` = ``{'embedding': {'word_embeddings': {'weight'},
  'position_embeddings': {'weight'}}, 'encoder': {'layers.N.<name>', 'final_layernorm.*'},
  'output_layer': {'weight'}}`` (layer numbers are local to a pipeline stage); or the same
  with flat mcore names (``embedding.word_embeddings.weight``, ``decoder.layers.N...``).
* Megatron-DeepSpeed: ``DIR/latest`` = ``global_stepN`` and ``global_stepN/`` with either
  ``mp_rank_{tp:02d}_model_states.pt`` (``module`` = the legacy model dict) or, for pipeline
  engines, ``layer_{i:02d}-model_{tp:02d}-model_states.pt`` per layer (embedding, then the
  transformer layers, then the final norm, numbered globally).
"""

from __future__ import annotations

import glob
import os
import re
from typing import Any, Optional

import torch

from megazero.checkpoint.megatron_pickle import load_megatron_file
from megazero.checkpoint.torch_dist import is_torch_dist
from megazero.model.config import GPTConfig
from megazero.model.interop.megatron_import import deepspeed_layer_names, flatten, megatron_names, megatron_to_megazero

__all__ = ["detect_foreign_checkpoint", "load_megatron_file", "import_megatron", "CONVERT_HINT"]

CONVERT_HINT = "python tools/convert_from_megatron.py --input {path} --output DIR, then train with --pretrained-checkpoint DIR"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def detect_foreign_checkpoint(path: str) -> Optional[str]:
    """A message naming the Megatron format of ``path`` and how to convert it, or None when ``path`` is not
    a Megatron-LM / Megatron-DeepSpeed checkpoint directory, or is one megazero reads as it is (torch_dist)."""
    if not path or not os.path.isdir(path):
        return None
    hint = CONVERT_HINT.format(path=path)
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    iteration_dir = path
    if os.path.isfile(tracker):
        it = _read(tracker)
        iteration_dir = os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}" if it.isdigit() else it)
    if is_torch_dist(path):
        return None  # Megatron-LM's torch_dist format: megazero reads it (megazero.checkpoint.torch_dist)
    ranks = sorted(glob.glob(os.path.join(iteration_dir, "mp_rank_*")))
    if ranks:
        names = [os.path.basename(r) for r in ranks]
        tp = len({n[8:10] for n in names})
        pp = len({n[11:14] for n in names}) if all(len(n) > 10 for n in names) else 1
        return (f"{path} is a Megatron-LM checkpoint (legacy mp_rank_XX format, tp={tp}, pp={pp}) that megazero "
                f"cannot resume; import its weights with: {hint}")
    latest = _read(os.path.join(path, "latest"))
    steps = glob.glob(os.path.join(path, "global_step*"))
    if re.fullmatch(r"global_step\d+", latest) or (steps and not latest.startswith("iter_")):
        return (f"{path} is a Megatron-DeepSpeed (DeepSpeed engine) checkpoint ({latest or os.path.basename(steps[0])}) "
                f"that megazero cannot resume; import its weights with: {hint}")
    if re.fullmatch(r"global_step\d+", os.path.basename(os.path.normpath(path))) and (
            glob.glob(os.path.join(path, "*model_states.pt"))):
        return f"{path} is one step of a Megatron-DeepSpeed checkpoint; import its weights with: {hint}"
    return None


# ---- reading a Megatron checkpoint's weights ------------------------------------------------------


def _deepspeed_layers(step_dir: str, tp: int, load) -> tuple[list[dict], Any]:
    """Per TP rank, the megazero-named weights of a DeepSpeed pipeline checkpoint (layer_XX files)."""
    per_rank = []
    for r in range(tp):
        files = sorted(glob.glob(os.path.join(step_dir, f"layer_*-model_{r:02d}-model_states.pt")),
                       key=lambda p: int(re.search(r"layer_(\d+)", os.path.basename(p)).group(1)))
        per_rank.append(deepspeed_layer_names((f, load(f)) for f in files))
    args_file = glob.glob(os.path.join(step_dir, "mp_rank_00*_model_states.pt"))
    args = load(args_file[0]).get("args") if args_file else None
    return per_rank, args


def import_megatron(path: str, vocab_size: Optional[int] = None, load=None) -> tuple[GPTConfig, dict[str, torch.Tensor], dict]:
    """Read a Megatron-LM legacy or Megatron-DeepSpeed checkpoint directory (or one iteration
    directory) -> ``(GPTConfig, full megazero state dict, info)``."""
    load = load or load_megatron_file
    info: dict[str, Any] = {}
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    ds_latest = os.path.join(path, "latest")
    step_dir = path
    if os.path.isfile(tracker):
        it = open(tracker).read().strip()
        step_dir = os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}")
        info["format"], info["iteration"] = "megatron-lm", it
    elif os.path.isfile(ds_latest):
        step_dir = os.path.join(path, open(ds_latest).read().strip())
        info["format"] = "megatron-deepspeed"
    if not os.path.isdir(step_dir):
        raise FileNotFoundError(f"{step_dir} (named by the checkpoint's tracker file) does not exist")
    layer_files = glob.glob(os.path.join(step_dir, "layer_*-model_*-model_states.pt"))
    if layer_files:
        tp = len({re.search(r"model_(\d+)-", os.path.basename(f)).group(1) for f in layer_files})
        shards, args = _deepspeed_layers(step_dir, tp, load)
        if args is None:
            raise ValueError(f"{step_dir}: no mp_rank_00_model_states.pt with the run's args")
        info.update(format="megatron-deepspeed-pipeline", tp=tp)
    else:
        rank_dirs = sorted(glob.glob(os.path.join(step_dir, "mp_rank_*")))
        ds_files = sorted(glob.glob(os.path.join(step_dir, "mp_rank_*_model_states.pt")))
        if rank_dirs and all(os.path.isdir(d) for d in rank_dirs):
            files = {}
            for d in rank_dirs:
                m = re.fullmatch(r"mp_rank_(\d+)(?:_(\d+))?", os.path.basename(d))
                files[(int(m.group(1)), int(m.group(2) or 0))] = os.path.join(d, "model_optim_rng.pt")
        elif ds_files:
            files = {(int(re.search(r"mp_rank_(\d+)", os.path.basename(f)).group(1)), 0): f for f in ds_files}
        else:
            raise FileNotFoundError(f"{step_dir} holds no Megatron mp_rank_* directories, mp_rank_*_model_states.pt "
                                    f"or layer_*-model_*-model_states.pt files")
        tp = 1 + max(t for t, _ in files)
        pp = 1 + max(p for _, p in files)
        ckpts = {key: load(f) for key, f in files.items()}
        args = ckpts[(0, 0)].get("args")
        if args is None:
            raise ValueError(f"{files[(0, 0)]} has no 'args' (cannot tell the model's shape)")
        version = ckpts[(0, 0)].get("checkpoint_version", 3.0)
        if version is not None and float(version) < 2.0:
            raise ValueError(f"checkpoint_version {version} stores QKV in an older order; load and re-save it with "
                             f"a current Megatron-LM first")
        if getattr(args, "virtual_pipeline_model_parallel_size", None):
            raise ValueError("interleaved (virtual) pipeline checkpoints are not supported; re-save without "
                             "--num-layers-per-virtual-pipeline-stage")
        per_stage = args.num_layers // pp
        shards = []
        for t in range(tp):
            merged = {}
            for p in range(pp):
                ck = ckpts[(t, p)]
                model = ck.get("model", ck.get("module"))
                if model is None:
                    raise KeyError(f"{files[(t, p)]} has no 'model' or 'module' entry")
                merged.update(megatron_names(flatten(model), p * per_stage))
            shards.append(merged)
        info.update(tp=tp, pp=pp)
        info.setdefault("format", "megatron-lm")
    config, full, info["gelu"] = megatron_to_megazero(shards, args, vocab_size)
    return config, full, info
