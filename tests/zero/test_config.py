"""DeepSpeed-schema configuration: accepted as written, refused by name when it cannot work."""

import json

import pytest
import torch

from megazero.zero import ZeroConfigError, load_config


def test_megatron_deepspeed_azure_config_is_accepted(tmp_path):
    # The ds_config.json of Megatron-DeepSpeed's azure scripts, minus the CPU offload block.
    cfg = {
        "train_batch_size": 64, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 1,
        "zero_optimization": {"stage": 3, "stage3_max_live_parameters": 3e9, "stage3_max_reuse_distance": 3e9,
                              "stage3_param_persistence_threshold": 1e5, "stage3_prefetch_bucket_size": 5e7,
                              "contiguous_gradients": True, "overlap_comm": True, "reduce_bucket_size": 90000000,
                              "sub_group_size": 1e9},
        "gradient_clipping": 1.0,
        "fp16": {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1,
                 "initial_scale_power": 15},
        "wall_clock_breakdown": True,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    c = load_config(str(path))
    assert c.stage == 3 and c.compute_dtype == torch.float16 and c.fp16.initial_scale_power == 15
    assert c.zero_optimization.stage3_param_persistence_threshold == 100000
    assert c.grad_dtype == torch.float16
    c.check_batch(16)
    with pytest.raises(ZeroConfigError, match=r"train_batch_size \(64\) != .*\(4\) x .*\(1\) x .*\(8\) = 32"):
        c.check_batch(8)


@pytest.mark.parametrize("cfg,message", [
    ({"zero_optimization": {"stage": 4}}, "stage must be 0, 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "offload_param needs stage 3"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "offload_param.device nvme needs"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "ratio": 0.5}}},
     "unknown key zero_optimization.offload_param.ratio"),
    ({"zero_optimization": {"cpu_offload": True}}, "unknown key zero_optimization.cpu_offload"),
    ({"zero_optimization": {"stgae": 2}}, "unknown key zero_optimization.stgae"),
    ({"bf16": {"enabled": True}, "fp16": {"enabled": True}}, "choose one precision"),
    ({"optimizer": {"type": "Lamb"}}, "not supported"),
    ({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "momentum": 0.9}}}, "unknown key optimizer.params.momentum"),
    ({"fp16": {"enabled": True, "scale": 4}}, "unknown key fp16.scale"),
    ({"train_micro_batch": 4}, "unknown top-level key 'train_micro_batch'"),
    ({"gradient_accumulation_steps": 0}, "must be >= 1"),
    ({"zero_optimization": {"stage": 3, "reduce_bucket_size": "big"}}, "must be a number"),
])
def test_bad_configs_are_refused_by_name(cfg, message):
    with pytest.raises(ZeroConfigError, match=message):
        load_config(cfg)


def test_adam_type_follows_deepspeed_adam_w_mode():
    assert load_config({"optimizer": {"type": "Adam"}}).optimizer.adam_w_mode is True
    assert load_config({"optimizer": {"type": "Adam", "params": {"adam_w_mode": False}}}).optimizer.adam_w_mode is False
    assert load_config({"data_types": {"grad_accum_dtype": "fp32"}, "bf16": {"enabled": True}}).grad_dtype == torch.float32


def test_listed_keys_are_the_parsed_fields():
    """HONOURED_KEYS + NO_EFFECT_KEYS (what load_config accepts) name every field the parser fills,
    so a new engine knob cannot be added without listing it (and tests/training/test_ds_keys.py then
    requires the training layer to pass it on)."""
    import dataclasses

    from megazero.zero.config import (HONOURED_KEYS, NO_EFFECT_KEYS, FP16Config, OffloadOptimizerConfig,
                                      OffloadParamConfig, OptimizerConfig, ZeroConfig, ZeroOptimizationConfig)

    def names(cls):
        return [f.name for f in dataclasses.fields(cls)]

    params = [f"optimizer.params.{n}" for n in names(OptimizerConfig) if n not in ("type", "settings")]
    blocks = {"optimizer": ["optimizer.type"] + params,
              "zero_optimization": [f"zero_optimization.{n}" for n in names(ZeroOptimizationConfig)
                                    if n not in ("offload_optimizer", "offload_param")]
              + [f"zero_optimization.offload_optimizer.{n}" for n in names(OffloadOptimizerConfig)]
              + [f"zero_optimization.offload_param.{n}" for n in names(OffloadParamConfig)],
              "fp16": ["fp16.enabled"] + [f"fp16.{n}" for n in names(FP16Config)],
              "bf16": ["bf16.enabled", "bfloat16.enabled"], "grad_accum_dtype": ["data_types.grad_accum_dtype"]}
    from_fields = {p for n in names(ZeroConfig) for p in blocks.get(n, [n])}
    listed = set(HONOURED_KEYS) | set(NO_EFFECT_KEYS)
    assert len(listed) == len(HONOURED_KEYS) + len(NO_EFFECT_KEYS)  # no path in both, none twice
    assert from_fields <= listed, sorted(from_fields - listed)
    # accepted and dropped by the parser: DeepSpeed's own knobs that no field holds
    assert listed - from_fields == {"zero_optimization.round_robin_gradients", "fp16.auto_cast"}
    # each no-effect key is accepted (DeepSpeed files load)
    load_config({"optimizer": {"params": {"torch_adam": True}}, "fp16": {"enabled": True, "auto_cast": False},
                 "steps_per_print": 5, "wall_clock_breakdown": True,
                 "zero_optimization": {
                     **{p.split(".")[1]: 1 for p in NO_EFFECT_KEYS if p.count(".") == 1 and p.startswith("zero_optimization.")},
                     "offload_optimizer": {p.split(".")[2]: True for p in NO_EFFECT_KEYS
                                           if p.startswith("zero_optimization.offload_optimizer.")}}})
    with pytest.raises(ZeroConfigError, match="unknown top-level key 'grad_accum_dtype'"):
        load_config({"grad_accum_dtype": "fp32"})  # a field's name is not a key: data_types.grad_accum_dtype is
