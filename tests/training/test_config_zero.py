"""``TrainConfig.zero_config()`` builds the engine's ``ZeroConfig`` from the typed configuration
field by field; a DeepSpeed user writing the same run as a JSON file gets the same engine
configuration from ``load_config``. Both are checked to agree, field by field, over
representative runs: precisions, stages 0-3, optimizer offload to cpu and nvme, parameter
offload, clipping, accumulation, SGD, and JSON-only engine knobs."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from megazero.config import parse_args
from megazero.config.ds_keys import strip_ignored
from megazero.zero.config import ZeroConfig, ZeroConfigError, load_config

TINY = "--model-preset gpt-tiny --micro-batch-size 2 --train-iters 10 --lr 1e-3 --mock-data".split()


def deepspeed_dict(cfg) -> dict:
    """The DeepSpeed JSON a user would write for ``cfg``: the --deepspeed-config JSON (if any)
    with the keys the command line owns written over it."""
    ds = strip_ignored(cfg.deepspeed_json) if cfg.deepspeed_json else {}
    s, o, p = cfg.schedule, cfg.optim, cfg.precision
    ds["train_batch_size"] = s.global_batch_size
    ds["train_micro_batch_size_per_gpu"] = s.micro_batch_size
    ds["gradient_accumulation_steps"] = s.grad_accum_steps
    opt = ds.setdefault("optimizer", {})
    opt["type"] = o.type
    if o.type == "SGD":
        opt["params"] = dict(lr=o.lr, momentum=o.settings.momentum, weight_decay=o.weight_decay)
    else:
        opt.setdefault("params", {}).update(
            lr=o.lr, betas=[o.adam_beta1, o.adam_beta2], eps=o.adam_eps, weight_decay=o.weight_decay)
    ds.setdefault("zero_optimization", {})["stage"] = cfg.parallel.zero_stage
    if o.offload_device is not None:
        offload = ds["zero_optimization"].setdefault("offload_optimizer", {})
        offload["device"] = o.offload_device
        if o.offload_fraction is not None:
            offload["ratio"] = o.offload_fraction
    ds.setdefault("bf16", {})["enabled"] = p.dtype == "bf16"
    fp16 = ds.setdefault("fp16", {})
    fp16["enabled"] = p.dtype == "fp16"
    fp16.update(loss_scale=p.loss_scale if p.loss_scale is not None else 0,
                initial_scale_power=int(round(math.log2(p.initial_loss_scale))),
                loss_scale_window=p.loss_scale_window, hysteresis=p.hysteresis, min_loss_scale=p.min_loss_scale)
    if p.consecutive_hysteresis:
        fp16["consecutive_hysteresis"] = True
    if p.accumulate_grads_fp32:
        ds.setdefault("data_types", {})["grad_accum_dtype"] = "fp32"
    ds["gradient_clipping"] = o.clip_grad
    ds["steps_per_print"] = cfg.logging.log_interval
    ds["wall_clock_breakdown"] = cfg.logging.wall_clock_breakdown
    return ds


def differences(a, b, where: str = "") -> list[str]:
    """Every leaf field where two dataclasses differ, by dotted name (value and type compared)."""
    if dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b) and type(a) is type(b):
        return [d for f in dataclasses.fields(a)
                for d in differences(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}".lstrip("."))]
    if a != b or (a is not None and b is not None and type(a) is not type(b) and not isinstance(a, (int, float))):
        return [f"{where}: {a!r} != {b!r}"]
    return []


NVME = "/tmp/megazero-config-zero"
JSONS = {
    "offload_nvme_bf16_z2": {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "nvme", "nvme_path": NVME, "buffer_count": 4, "pin_memory": True, "fast_init": False}}},
    "offload_cpu_partial_z1": {"zero_optimization": {"stage": 1, "offload_optimizer": {
        "device": "cpu", "ratio": 0.5, "buffer_size": 1 << 16}}, "gradient_clipping": 0.3},
    "offload_param_nvme_z3_fp16": {
        "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "consecutive_hysteresis": True},
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": NVME, "max_in_cpu": 0,
                                                            "buffer_count": 3, "buffer_size": 1e5},
                              "offload_optimizer": {"device": "cpu"}}},
    "engine_knobs_z3": {
        "optimizer": {"type": "Adam", "params": {"adam_w_mode": False, "torch_adam": True}},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": 2000, "stage3_prefetch_bucket_size": 5e7,
                              "stage3_max_live_parameters": 3e9, "stage3_param_persistence_threshold": 10,
                              "overlap_comm": False, "max_reduce_in_flight": 2, "allgather_bucket_size": 5e8,
                              "sub_group_size": 1e9},
        "communication_data_type": "bfloat16", "prescale_gradients": True, "gradient_predivide_factor": 2.0,
        "data_types": {"grad_accum_dtype": "fp32"}, "bf16": {"enabled": True}, "steps_per_print": 7,
        "wall_clock_breakdown": True, "gradient_accumulation_steps": 2},
    "sgd_z2": {"optimizer": {"type": "SGD", "params": {"momentum": 0.5}}, "zero_optimization": {"stage": 2}},
}
FLAGS = {
    "fp32_z1": "",
    "bf16_z2_clip": "--bf16 --zero-stage 2 --clip-grad 0.5",
    "fp16_static_z3": "--fp16 --zero-stage 3 --loss-scale 1024",
    "fp16_dynamic_z1": "--fp16 --initial-loss-scale 4096 --loss-scale-window 50 --hysteresis 3 --min-loss-scale 2",
    "z0_no_clip": "--zero-stage 0 --clip-grad 0",
    "accumulation": "--global-batch-size 32 --bf16 --accumulate-allreduce-grads-in-fp32",
    "sgd": "--optimizer sgd --sgd-momentum 0.5 --zero-stage 1",
    "cpu_offload_fraction": "--optimizer-cpu-offload --optimizer-offload-fraction 0.5 --zero-stage 2 --bf16",
    "cpu_offload_z3": "--optimizer-cpu-offload --zero-stage 3 --fp16",
}


def _parse(tmp_path, flags: str = "", ds: dict = None):
    argv = TINY + flags.split()
    if ds is not None:
        path = tmp_path / "ds.json"
        path.write_text(json.dumps(ds))
        argv += ["--deepspeed_config", str(path)]
    return parse_args(argv, 4)


@pytest.mark.parametrize("name", list(FLAGS) + [f"json:{k}" for k in JSONS] + ["json+flag:offload_cpu"])
def test_zero_config_equals_the_deepspeed_json_of_the_same_run(tmp_path, name):
    if name.startswith("json+flag"):
        cfg = _parse(tmp_path, "--cpu-optimizer --bf16", {"zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "cpu", "pin_memory": True, "buffer_count": 2}}})
    elif name.startswith("json:"):
        cfg = _parse(tmp_path, "", JSONS[name[5:]])
    else:
        cfg = _parse(tmp_path, FLAGS[name])
    typed = cfg.zero_config()
    assert isinstance(typed, ZeroConfig)
    assert differences(typed, load_config(deepspeed_dict(cfg))) == []


def test_the_json_knobs_reach_the_typed_config(tmp_path):
    z = _parse(tmp_path, "", JSONS["engine_knobs_z3"]).zero_config()
    assert (z.stage, z.zero_optimization.reduce_bucket_size, z.zero_optimization.stage3_max_live_parameters) == \
        (3, 2000, 3_000_000_000)
    assert (z.optimizer.type, z.optimizer.adam_w_mode, z.optimizer.torch_adam) == ("Adam", False, False)
    assert (z.communication_data_type, z.prescale_gradients, z.gradient_predivide_factor) == ("bf16", True, 2.0)
    assert z.gradient_accumulation_steps == 2 and z.train_batch_size == 16 and z.wall_clock_breakdown
    off = _parse(tmp_path, "", JSONS["offload_nvme_bf16_z2"]).zero_config().zero_optimization.offload_optimizer
    assert (off.device, off.nvme_path, off.buffer_count, off.pin_memory) == ("nvme", NVME, 4, True)


def test_zero_config_refuses_what_the_engine_refuses(tmp_path):
    cfg = _parse(tmp_path, "--bf16 --zero-stage 2")
    cfg.parallel.zero_stage = 0
    cfg.optim.offload_device = "cpu"
    with pytest.raises(ZeroConfigError, match="offload_optimizer needs stage 1, 2 or 3"):
        cfg.zero_config()
    with pytest.raises(ZeroConfigError, match="offload_optimizer needs stage 1, 2 or 3"):
        load_config(deepspeed_dict(cfg))
