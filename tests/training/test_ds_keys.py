"""Every DeepSpeed JSON key the ZeRO engine honours reaches it through the command line.

The engine lists the keys it acts on (``megazero.zero.config.HONOURED_KEYS``). For each one,
a ``--deepspeed_config`` JSON setting it is parsed by ``parse_args``; the key must be classified
honoured by ``megazero.config.ds_keys`` and change the engine that ``megazero.zero.initialize``
builds from ``TrainConfig.zero_config()``.
"""

import copy
import json

import pytest
import torch

from megazero import zero
from megazero.model import GPTModel
from megazero.config import parse_args
from megazero.config import ds_keys
from megazero.zero.config import HONOURED_KEYS, NO_EFFECT_KEYS, ZeroOptimizationConfig

BASE = "--model-preset gpt-tiny --train-iters 2 --mock-data --hidden-dropout 0 --attention-dropout 0".split()
# Filled in every JSON (the command line above gives neither): the run needs a micro-batch and an LR.
CONTEXT = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"params": {"lr": 1e-3}}}
Z3 = {"zero_optimization": {"stage": 3}}


def _z3(**knobs):
    return {"zero_optimization": {"stage": 3, **knobs}}


def _off(**keys):
    return {"zero_optimization": {"stage": 2, "offload_optimizer": keys}}


def _po(**keys):
    # Threshold 0: every parameter of the small model is partitioned (none persistent), so offloaded.
    return {"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0, "offload_param": keys}}


def _fp16(**keys):
    return {"fp16": {"enabled": True, **keys}}


# path -> (JSON holding it, with a non-default value; what the engine built from it shows, expected)
SAMPLES = {
    "train_batch_size": ({"train_batch_size": 6}, lambda e: (e.config.train_batch_size, e.accum), (6, 3)),
    "train_micro_batch_size_per_gpu": ({"train_micro_batch_size_per_gpu": 3},
                                       lambda e: e.config.train_micro_batch_size_per_gpu, 3),
    "gradient_accumulation_steps": ({"gradient_accumulation_steps": 3}, lambda e: e.accum, 3),
    "optimizer.type": ({"optimizer": {"type": "SGD"}}, lambda e: type(e.optimizer), torch.optim.SGD),
    "optimizer.params.lr": ({"optimizer": {"params": {"lr": 0.02}}},
                            lambda e: (e.config.optimizer.lr, e.optimizer.param_groups[0]["lr"]), (0.02, 0.02)),
    "optimizer.params.betas": ({"optimizer": {"params": {"betas": [0.8, 0.9]}}},
                               lambda e: e.optimizer.param_groups[0]["betas"], (0.8, 0.9)),
    "optimizer.params.eps": ({"optimizer": {"params": {"eps": 1e-5}}}, lambda e: e.optimizer.param_groups[0]["eps"],
                             1e-5),
    "optimizer.params.weight_decay": ({"optimizer": {"params": {"weight_decay": 0.2}}},
                                      lambda e: e.optimizer.param_groups[0]["weight_decay"], 0.2),
    "optimizer.params.adam_w_mode": ({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}},
                                     lambda e: type(e.optimizer), torch.optim.Adam),
    "optimizer.params.momentum": ({"optimizer": {"type": "SGD", "params": {"momentum": 0.5}}},
                                  lambda e: e.optimizer.param_groups[0]["momentum"], 0.5),
    "optimizer.params.muon_lr": ({"optimizer": {"type": "Muon", "params": {"muon_lr": 0.05}}},
                                 lambda e: [g["lr"] for g in e.optimizer.param_groups if g["per_matrix"]], [0.05]),
    "optimizer.params.adam_lr": ({"optimizer": {"type": "Muon", "params": {"adam_lr": 2e-4}}},
                                 lambda e: {g["lr"] for g in e.optimizer.param_groups if not g["per_matrix"]}, {2e-4}),
    "zero_optimization.stage": ({"zero_optimization": {"stage": 2}}, lambda e: (e.stage, e.window is None), (2, True)),
    "zero_optimization.overlap_comm": (_z3(overlap_comm=False), lambda e: e.config.zero_optimization.overlap_comm,
                                       False),
    "zero_optimization.reduce_bucket_size": (_z3(reduce_bucket_size=1000), lambda e: e.reducer.bucket_numel, 1000),
    "zero_optimization.max_reduce_in_flight": (_z3(max_reduce_in_flight=3), lambda e: e.reducer.max_in_flight, 3),
    "zero_optimization.stage3_prefetch_bucket_size": (_z3(stage3_prefetch_bucket_size=1234),
                                                      lambda e: e.window.prefetch_numel, 1234),
    "zero_optimization.stage3_max_live_parameters": (_z3(stage3_max_live_parameters=5678),
                                                     lambda e: e.window.max_live_numel, 5678),
    # 0: nothing stays gathered, so every group of the model is released (resident only above the threshold)
    "zero_optimization.stage3_param_persistence_threshold": (
        _z3(stage3_param_persistence_threshold=0), lambda e: any(u.resident for u in e.units), False),
    "zero_optimization.stage3_keep_gathered_in_step": (_z3(stage3_keep_gathered_in_step=True),
                                                       lambda e: (e.hold, e.window.hold, e.reducer), (True, True, None)),
    "zero_optimization.offload_optimizer.device": (_off(device="cpu"), lambda e: (e.offload is not None,
                                                                                  e.optimizer.state == {}), (True, True)),
    "zero_optimization.offload_optimizer.nvme_path": (_off(device="nvme", nvme_path="/tmp/megazero-ds-keys"),
                                                      lambda e: e.offload.config.nvme_path, "/tmp/megazero-ds-keys"),
    "zero_optimization.offload_optimizer.pin_memory": (_off(device="cpu", pin_memory=True),
                                                       lambda e: e.offload.config.pin_memory, True),
    "zero_optimization.offload_optimizer.buffer_count": (_off(device="cpu", buffer_count=3),
                                                         lambda e: len(e.offload.ring), 3),
    "zero_optimization.offload_optimizer.buffer_size": (_off(device="cpu", buffer_size=8192),
                                                        lambda e: e.offload.chunk, 8192),
    "zero_optimization.offload_optimizer.ratio": (_off(device="cpu", ratio=0.5), lambda e: 0 < len(e.offload.groups)
                                                  < len(e.trainable_groups), True),
    "zero_optimization.offload_param.device": (_po(device="cpu"), lambda e: (
        e.param_offload is not None, all(e.param_offload.owns(g) for g in e.groups if not g.resident)), (True, True)),
    "zero_optimization.offload_param.nvme_path": (_po(device="nvme", nvme_path="/tmp/megazero-ds-keys"),
                                                  lambda e: e.param_offload.config.nvme_path, "/tmp/megazero-ds-keys"),
    "zero_optimization.offload_param.pin_memory": (_po(device="cpu", pin_memory=True),
                                                   lambda e: e.param_offload.config.pin_memory, True),
    "zero_optimization.offload_param.buffer_count": (_po(device="nvme", nvme_path="/tmp/megazero-ds-keys", max_in_cpu=0,
                                                         buffer_count=3), lambda e: len(e.param_offload.ring), 3),
    "zero_optimization.offload_param.buffer_size": (_po(device="nvme", nvme_path="/tmp/megazero-ds-keys", max_in_cpu=0, buffer_size=100),
                                                    lambda e: e.param_offload.chunk_bytes // e.compute_dtype.itemsize,
                                                    100),
    "zero_optimization.offload_param.max_in_cpu": (_po(device="nvme", nvme_path="/tmp/megazero-ds-keys", max_in_cpu=0), lambda e: (
        e.model_state_bytes()["host_params"], e.model_state_bytes()["nvme_params"] > 0), (0, True)),
    "fp16.enabled": (_fp16(), lambda e: e.compute_dtype, torch.float16),
    "fp16.loss_scale": (_fp16(loss_scale=128), lambda e: (e.loss_scaler.dynamic, e.loss_scaler.scale), (False, 128.0)),
    "fp16.initial_scale_power": (_fp16(initial_scale_power=10), lambda e: e.loss_scaler.scale, 1024.0),
    "fp16.loss_scale_window": (_fp16(loss_scale_window=50), lambda e: e.loss_scaler.window, 50),
    "fp16.hysteresis": (_fp16(hysteresis=3), lambda e: e.loss_scaler.hysteresis, 3),
    "fp16.min_loss_scale": (_fp16(min_loss_scale=0.5), lambda e: e.loss_scaler.min_scale, 0.5),
    "fp16.consecutive_hysteresis": (_fp16(consecutive_hysteresis=True),
                                    lambda e: e.loss_scaler.consecutive_hysteresis, True),
    "bf16.enabled": ({"bf16": {"enabled": True}}, lambda e: e.compute_dtype, torch.bfloat16),
    "bfloat16.enabled": ({"bfloat16": {"enabled": True}}, lambda e: e.compute_dtype, torch.bfloat16),
    "gradient_clipping": ({"gradient_clipping": 0.25}, lambda e: e.config.gradient_clipping, 0.25),
    "data_types.grad_accum_dtype": ({"data_types": {"grad_accum_dtype": "bf16"}}, lambda e: e.grad_dtype,
                                    torch.bfloat16),
    "communication_data_type": ({"communication_data_type": "bf16"}, lambda e: e.reduce_dtype, torch.bfloat16),
    "prescale_gradients": ({"prescale_gradients": True, "gradient_predivide_factor": 4.0},
                           lambda e: (e.config.prescale_gradients, e._predivide), (True, 4.0)),
    "gradient_predivide_factor": ({"prescale_gradients": True, "gradient_predivide_factor": 2.0},
                                  lambda e: e.config.gradient_predivide_factor, 2.0),
}


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def _parse(tmp_path, obj: dict):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_merge(CONTEXT, obj)))
    return parse_args(BASE + ["--deepspeed_config", str(path)], 1)


def test_every_engine_key_has_a_sample():
    assert set(SAMPLES) == set(HONOURED_KEYS)


def test_ds_keys_honours_exactly_the_engine_keys_plus_the_training_layers():
    honoured = {k.path for k in ds_keys.DS_KEYS if k.status == ds_keys.HONOURED}
    missing = [p for p in HONOURED_KEYS if p not in honoured]
    assert not missing, f"engine keys not classified honoured in ds_keys: {missing}"
    # What ds_keys honours beyond the engine's keys is the training layer's (logging, monitors).
    assert honoured - set(HONOURED_KEYS) == {"wall_clock_breakdown", "tensorboard.*", "csv_monitor.*", "wandb.*"}
    # Keys the engine parses without effect are not advertised as engine knobs.
    for p in NO_EFFECT_KEYS:
        row = ds_keys._lookup(p)
        assert row is not None and (row.status != ds_keys.HONOURED or p == "wall_clock_breakdown"), p


@pytest.mark.parametrize("path", HONOURED_KEYS)
def test_engine_key_reaches_the_engine_through_parse_args(tmp_path, path):
    obj, shown, expected = SAMPLES[path]
    cfg = _parse(tmp_path, obj)
    assert not any(path in n for n in cfg.notes if n.startswith("DeepSpeed JSON keys ignored")), cfg.notes
    torch.manual_seed(0)
    engine = zero.initialize(GPTModel(cfg.model, device="meta"), cfg.zero_config())
    assert shown(engine) == expected, path


def test_all_zero3_knobs_together_are_not_stripped(tmp_path):
    knobs = dict(reduce_bucket_size=2000, stage3_prefetch_bucket_size=3000, stage3_max_live_parameters=40000,
                 max_reduce_in_flight=1, stage3_keep_gathered_in_step=False, overlap_comm=False,
                 stage3_param_persistence_threshold=10, allgather_bucket_size=5e8)  # the last one: DeepSpeed's own
    cfg = _parse(tmp_path, _z3(**knobs))
    z = cfg.zero_config().zero_optimization
    assert z.stage == 3 and z.allgather_bucket_size == ZeroOptimizationConfig().allgather_bucket_size
    assert {k: getattr(z, k) for k in knobs if k != "allgather_bucket_size"} == \
        {k: v for k, v in knobs.items() if k != "allgather_bucket_size"}
    assert "DeepSpeed JSON keys ignored (they tune DeepSpeed's own internals): " \
        "zero_optimization.allgather_bucket_size" in cfg.notes


def test_memory_plan_uses_the_json_bucket_sizes(tmp_path):
    from megazero.observe import estimate_memory_for

    default = estimate_memory_for(_parse(tmp_path, Z3))  # one unit per bucket, the next unit prefetched
    # DeepSpeed's element counts: the whole (tiny) model in one bucket and prefetched
    est = estimate_memory_for(_parse(tmp_path, _z3(reduce_bucket_size=500_000_000, stage3_prefetch_bucket_size=50_000_000)))
    assert est.grad_buckets > default.grad_buckets and est.buffers >= default.buffers  # (2 layers: one ahead either way)
    none = estimate_memory_for(_parse(tmp_path, _z3(stage3_prefetch_bucket_size=0)))  # no prefetch
    assert none.buffers < default.buffers


def test_ds_keys_does_not_import_the_config_module():
    """config.py uses ds_keys; ds_keys must not import config back (ConfigError lives in errors.py)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(ds_keys))
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in imported if m and m.startswith("megazero")} == {"megazero.config.errors"}
