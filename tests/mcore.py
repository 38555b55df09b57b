"""megatron-core as a test oracle: it writes Megatron-LM-shaped ``torch_dist`` checkpoints, trains, and computes logits.

* :func:`write_mcore_checkpoint` builds megatron-core's ``GPTModel`` for a megazero :class:`GPTConfig` at a
  (tp, pp, ep, dp) layout on CPU gloo ranks and saves it as Megatron-LM's ``save_checkpoint`` does with
  ``--ckpt-format torch_dist --no-save-optim``: ``latest_checkpointed_iteration.txt`` and ``iter_{N:07d}/``
  holding ``dist_checkpointing.save`` of ``generate_state_dict``'s dict (args, checkpoint_version, iteration,
  model, num_floating_point_operations_so_far, rng_state).
* :func:`train_mcore` trains that model with megatron-core's distributed optimizer (:mod:`tests.mcore_train`),
  saves it mid-run with the optimizer and its scheduler in the distributed optimizer's sharding types, and
  returns the losses of the whole run: the continuation a resume must reproduce.
* :func:`mcore_logits` loads such a directory into megatron-core's model at any layout (megatron-core does
  the resharding) and returns the full-vocabulary logits.

The stored ``args`` are Megatron-LM's (:mod:`tests.megatron_lm_args`: its argument defaults, the
TransformerConfig the model was built from, the command line's values). Each call spawns all its ranks once
(megatron-core's import is the slow part). Weights are megatron-core's CPU initialisation from ``seed``; every
norm weight and bias then gets seeded noise, so a loader that maps a norm or a bias to the wrong place cannot
agree with megatron-core's logits.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import tempfile
import zlib
from typing import Any, Optional, Union

import pytest
import torch

from tests.mcore_cpu import (MLACoreAttention, cpu_optimizer_shims, cpu_shims, grouped_gemm_shim,
                             let_grouped_experts_run_fp32)
from tests.megatron_lm_args import POSITION_EMBEDDING, RUN_FLAGS, megatron_lm_args_on_rank, model_flags


def _have_mcore() -> bool:
    """Whether megatron-core is installed, without importing it here (its import takes seconds)."""
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except ImportError:  # no 'megatron' package at all
        return False


HAVE_MCORE = _have_mcore()

requires_mcore = pytest.mark.skipif(
    not HAVE_MCORE, reason="megatron-core (the bench extra: pip install -e .[bench]) is not installed")

__all__ = ["HAVE_MCORE", "requires_mcore", "write_mcore_checkpoint", "train_mcore", "mcore_logits",
           "mcore_parameter_names", "transformer_config", "data_parallel_size"]

TRACKER = "latest_checkpointed_iteration.txt"


# ---- megazero GPTConfig -> megatron-core ------------------------------------------------------------------

def _activation(name: str):
    import torch.nn.functional as F

    if name == "swiglu":
        return F.silu
    if name == "gelu":  # megazero's gelu is the tanh approximation
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "squared_relu":
        return lambda x: torch.pow(F.relu(x), 2)
    raise ValueError(f"activation {name!r} has no megatron-core equivalent here")


def _moe_kwargs(config, grouped_gemm: bool) -> dict:
    if config.num_experts is None:
        return {}
    freq = config.moe_layer_freq
    return dict(
        num_moe_experts=config.num_experts, moe_router_topk=config.moe_router_topk,
        moe_ffn_hidden_size=config.moe_ffn_size, moe_layer_freq=list(freq) if isinstance(freq, tuple) else freq,
        moe_shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
        moe_shared_expert_gate=config.moe_shared_expert_gate,
        moe_router_pre_softmax=config.moe_router_pre_softmax,
        moe_router_score_function=config.moe_router_score_function,
        moe_router_topk_scaling_factor=config.moe_router_topk_scaling_factor,
        moe_router_num_groups=config.moe_router_num_groups, moe_router_group_topk=config.moe_router_group_topk,
        moe_router_enable_expert_bias=config.moe_router_enable_expert_bias,
        moe_router_load_balancing_type=config.moe_router_load_balancing_type,
        moe_aux_loss_coeff=config.moe_aux_loss_coeff, moe_grouped_gemm=grouped_gemm,
        moe_token_dispatcher_type="allgather",
    )


def _mla_kwargs(config) -> dict:
    if not config.multi_latent_attention:
        return {}
    return dict(
        multi_latent_attention=True, q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
        qk_head_dim=config.qk_head_dim, qk_pos_emb_head_dim=config.qk_pos_emb_head_dim,
        v_head_dim=config.v_head_dim, rope_type=config.resolved_rope_type,
        rotary_base=config.rotary_base, rotary_percent=config.rotary_percent,
        rotary_scaling_factor=config.rotary_scaling_factor,
        original_max_position_embeddings=config.original_max_position_embeddings,
        beta_fast=config.beta_fast, beta_slow=config.beta_slow, mscale=config.mscale,
        mscale_all_dim=config.mscale_all_dim,
    )


def transformer_config(config, tp: int = 1, pp: int = 1, ep: int = 1, *, grouped_gemm: bool = False):
    """megatron-core's TransformerConfig (MLATransformerConfig under multi-latent attention) for ``config``."""
    from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

    if config.apply_layernorm_1p:
        raise ValueError("apply_layernorm_1p needs apex or Transformer Engine norms in megatron-core; "
                         "the fixture builds the local spec only: use apply_layernorm_1p=False")
    kw = dict(
        num_layers=config.num_layers, hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads, ffn_hidden_size=config.ffn_size,
        gated_linear_unit=config.activation == "swiglu", activation_func=_activation(config.activation),
        normalization="RMSNorm" if config.normalization == "rmsnorm" else "LayerNorm",
        layernorm_epsilon=config.layernorm_epsilon, add_bias_linear=config.add_bias_linear,
        add_qkv_bias=config.add_qkv_bias, qk_layernorm=config.qk_layernorm,
        hidden_dropout=config.hidden_dropout, attention_dropout=config.attention_dropout,
        init_method_std=config.init_method_std,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
        use_cpu_initialization=True, pipeline_dtype=torch.float32, params_dtype=torch.float32,
        bias_activation_fusion=False, bias_dropout_fusion=False, masked_softmax_fusion=False,
        apply_rope_fusion=False, persist_layer_norm=False, gradient_accumulation_fusion=False,
        transformer_impl="local",  # the layer specs built here are the local ones
    )
    kw.update(_moe_kwargs(config, grouped_gemm))
    if config.multi_latent_attention:
        if config.latent_norm_epsilon != config.layernorm_epsilon:
            raise ValueError("megatron-core's MLA latent norms take layernorm_epsilon: leave "
                             "latent_layernorm_epsilon unset (or equal) for the fixture")
        kw["qk_layernorm"] = True  # megazero's MLA always has its latent norms (Megatron's --qk-layernorm)
        kw.update(_mla_kwargs(config))
        return MLATransformerConfig(**kw)
    kw.update(num_query_groups=config.query_groups, kv_channels=config.head_dim)
    return TransformerConfig(**kw)


def data_parallel_size(tp: int, ep: int, dp: int) -> int:
    """The data-parallel size a run needs: megatron-core's expert grid (expert tp = tp) takes ep out of dp."""
    return dp * ep // math.gcd(dp, ep)


# ---- ranks ---------------------------------------------------------------------------------------------------

def _spawn(job: dict, world: int) -> None:
    """``job`` on ``world`` gloo ranks of a pool kept for megatron-core (imported once per worker; its CPU shims
    stay in those workers)."""
    from tests.distributed import run_distributed

    run_distributed(world, _rank_main, job, pool_name="megatron-core", timeout_s=600)


def _rank_main(job: dict) -> None:
    import warnings

    import torch.distributed as dist

    warnings.filterwarnings("ignore")
    cpu_shims()
    from megatron.core import parallel_state as ps

    try:
        ps.initialize_model_parallel(job["tp"], job["pp"], expert_model_parallel_size=job["ep"])
        with cpu_optimizer_shims() if job.get("optimizer") else contextlib.nullcontext():
            {"save": _save_on_rank, "logits": _logits_on_rank, "names": _names_on_rank}[job["kind"]](job)
        dist.barrier()
    finally:
        ps.destroy_model_parallel()


# ---- on each rank ----------------------------------------------------------------------------------------------

def _layer_spec(config, tcfg):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    if config.num_experts is not None:  # per-layer specs: moe_layer_freq may mix dense and expert layers
        spec = get_gpt_decoder_block_spec(tcfg, use_transformer_engine=False, normalization=tcfg.normalization)
        layers = spec.layer_specs
    else:
        spec = get_gpt_layer_local_spec(None, False, tcfg.qk_layernorm, config.multi_latent_attention,
                                        normalization=tcfg.normalization)
        layers = [spec]
    if config.multi_latent_attention:
        for layer in layers:
            layer.submodules.self_attention.submodules.core_attention = MLACoreAttention
    return spec


def _build_model(job: dict):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    config = job["config"]
    if job["grouped_gemm"]:
        grouped_gemm_shim()
    tcfg = transformer_config(config, job["tp"], job["pp"], job["ep"], grouped_gemm=job["grouped_gemm"])
    torch.manual_seed(job["seed"])  # use_cpu_initialization draws every full weight from this generator
    model = GPTModel(
        tcfg, _layer_spec(config, tcfg), vocab_size=config.padded_vocab_size,
        max_sequence_length=config.max_position_embeddings,
        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
        share_embeddings_and_output_weights=config.tie_embeddings,
        # MLA: its attention makes its own RoPE
        position_embedding_type=POSITION_EMBEDDING[config.position_embedding_type],
        rotary_percent=config.rotary_percent, rotary_base=int(config.rotary_base))
    if job["grouped_gemm"]:
        let_grouped_experts_run_fp32(model)
    return model


def _shard_seed(seed: int, name: str, param) -> int:
    """A seed for one rank's piece of a parameter: equal on the ranks that hold the same piece."""
    from megatron.core import parallel_state as ps

    tp = ps.get_tensor_model_parallel_rank() if getattr(param, "tensor_model_parallel", False) else -1
    expert = not getattr(param, "allreduce", True)
    ep = ps.get_expert_model_parallel_rank() if expert else -1
    if expert:
        tp = ps.get_expert_tensor_parallel_rank() if getattr(param, "tensor_model_parallel", False) else -1
    key = f"{seed}|{ps.get_pipeline_model_parallel_rank()}|{tp}|{ep}|{name}"
    return zlib.crc32(key.encode())


def _perturb_norms_and_biases(model, seed: int) -> None:
    """megatron-core starts norms at 1 and biases at 0; seeded noise makes each of them distinct."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                g = torch.Generator().manual_seed(_shard_seed(seed, name, p))
                p.add_(0.2 * torch.randn(p.shape, generator=g))


def _sharded_metadata(optimizer_format: Optional[str]) -> dict:
    """Megatron-LM's _build_sharded_state_dict_metadata for a run with or without the distributed optimizer."""
    from megatron.core import parallel_state as ps

    meta = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if optimizer_format is not None:
        meta["distrib_optim_sharding_type"] = optimizer_format
        if optimizer_format == "fully_reshardable":
            meta["distrib_optim_fully_reshardable_mem_efficient"] = False
    meta["dp_cp_group"] = ps.get_data_parallel_group(with_context_parallel=True)
    return meta


def _rng_state():
    """Megatron-LM's get_rng_state for torch_dist: one ShardedObject over the (pp, tp) grid, replicated over dp.
    On CPU there is no CUDA generator: 'cuda_rng_state' holds the CPU generator's state in its place."""
    import random

    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    state = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
             "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}
    return ShardedObject("rng_state", [state], (ps.get_pipeline_model_parallel_world_size(),
                                                ps.get_tensor_model_parallel_world_size()),
                         (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank()),
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def _save(state: dict, directory: str, iteration: int, meta: dict) -> None:
    """Megatron-LM's save_checkpoint of ``state`` for ``iteration`` into ``directory`` (with its tracker)."""
    import torch.distributed as dist
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    state.update(rng_state=_rng_state(), num_floating_point_operations_so_far=float(iteration) * 1e9)
    iter_dir = os.path.join(directory, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(iter_dir, exist_ok=True)
    dist.barrier()
    strategy = FullyParallelSaveStrategyWrapper(TorchDistSaveShardedStrategy("torch_dist", 1),
                                                ps.get_data_parallel_group(with_context_parallel=True))
    content = {k: v for k, v in meta.items() if k != "dp_cp_group"}
    dist_checkpointing.save(state, iter_dir, strategy, validate_access_integrity=True, content_metadata=content)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(directory, TRACKER), "w") as f:
            f.write(str(iteration))


def _save_on_rank(job: dict) -> None:
    """The model (and with ``optimizer`` its training: ``iters`` iterations, saved after ``save_at`` in each of
    ``formats``), as Megatron-LM's generate_state_dict and save_checkpoint write it."""
    import copy
    import json

    import torch.distributed as dist

    model = _build_model(job)
    _perturb_norms_and_biases(model, job["seed"])
    args, at = megatron_lm_args_on_rank(model, job), job["save_at"]
    if not job["optimizer"]:  # --no-save-optim: neither the optimizer nor its scheduler is saved
        meta = _sharded_metadata(None)
        _save({"args": args, "checkpoint_version": 3.0, "iteration": at,
               "model": model.sharded_state_dict(metadata=meta)}, job["out"], at, meta)
        return
    from tests.mcore_train import MegatronCoreRun

    run = MegatronCoreRun(model, args, job["vocab"])
    metrics = {}
    for it in range(1, job["iters"] + 1):
        metrics[it] = run.step(it)
        if it != at:
            continue
        for fmt in job["formats"]:
            meta = _sharded_metadata(None if fmt == "non_distributed" else fmt)
            saved = copy.copy(args)
            saved.dist_ckpt_optim_fully_reshardable = fmt == "fully_reshardable"
            state = {"args": saved, "checkpoint_version": 3.0, "iteration": at}
            state["model"] = model.sharded_state_dict(metadata=meta)  # unwrapped, as save_checkpoint does
            state["optimizer"] = run.optimizer.sharded_state_dict(state, metadata=meta)
            state["opt_param_scheduler"] = run.scheduler.state_dict()
            _save(state, os.path.join(job["out"], fmt), at, meta)
    if dist.get_rank() == 0:
        with open(job["metrics"], "w") as f:
            json.dump(metrics, f)


def _iter_dir(path: str) -> str:
    tracker = os.path.join(path, TRACKER)
    if os.path.isfile(tracker):
        with open(tracker) as f:
            return os.path.join(path, f"iter_{int(f.read().strip()):07d}")
    return path


def _load_model(model, path: str) -> None:
    """megatron-core's strict load of every model tensor; the checkpoint's other keys (optimizer, rng) may stay."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    request = model.sharded_state_dict(metadata=_sharded_metadata(None))
    loaded, missing, unexpected = dist_checkpointing.load(request, _iter_dir(path), strict=StrictHandling.RETURN_ALL)
    # megatron-core's words: 'unexpected' = asked for but not in the checkpoint, 'missing' = in it, not asked for
    left = [k for k in missing if not k.startswith(("optimizer.", "rng_state", "rerun_state_machine"))]
    if unexpected or left:
        raise RuntimeError(f"checkpoint {path} does not match megatron-core's model: absent {sorted(unexpected)}, "
                           f"not loaded {sorted(left)}")
    model.load_state_dict({k: v for k, v in loaded.items() if k in request}, strict=True)  # less common.pt


def _forward(model, tokens: torch.Tensor) -> Optional[torch.Tensor]:
    """One eval forward through this rank's stage; hidden states pass between stages by send/recv.
    The last stage returns its vocabulary shard's logits [b, s, v/tp], the others None."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    b, s = tokens.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, s)
    first, last = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
    if not first:
        hidden = torch.empty(s, b, model.config.hidden_size)
        dist.recv(hidden, src=ps.get_pipeline_model_parallel_prev_rank())
        model.set_input_tensor(hidden)
    with torch.no_grad():
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True: not attended
        out = model(tokens if first else None, positions, mask)
    if not last:
        dist.send(out.contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
        return None
    return out


def _logits_on_rank(job: dict) -> None:
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    model = _build_model(job)
    results = []
    for path in job["paths"]:  # one model, each checkpoint loaded strictly over the last
        _load_model(model, path)
        model.eval()
        out = _forward(model, job["tokens"])
        if out is None:
            continue
        group = ps.get_tensor_model_parallel_group()
        parts = [torch.empty_like(out) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, out.contiguous(), group=group)
        results.append(torch.cat(parts, dim=-1).float())
    if results and ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
        torch.save(results, job["result"])


def _names_on_rank(job: dict) -> None:
    names = [[n for n, _ in _build_model({**job, "config": c}).named_parameters()] for c in job["configs"]]
    torch.save(names, job["result"])


# ---- the entry points ----------------------------------------------------------------------------------

def _job(config, tp: int, pp: int, ep: int, dp: int, **kw) -> tuple[dict, int]:
    config.validate(tp)
    dp = data_parallel_size(tp, ep, dp)
    job = dict(config=config, tp=tp, pp=pp, ep=ep, dp=dp, grouped_gemm=False, seed=1234, **kw)
    return job, tp * pp * dp


def write_mcore_checkpoint(out: str, config, tp: int = 1, pp: int = 1, ep: int = 1, *, dp: int = 1,
                           iteration: int = 10, seed: int = 1234, grouped_gemm: bool = False, **flags: Any) -> None:
    """megatron-core writes a Megatron-LM ``torch_dist`` checkpoint directory ``out`` of a model with megazero
    GPTConfig ``config`` at tp x pp x ep (x dp: raised to a multiple of ep, as megatron-core's expert grid
    needs), as a run saved with ``--no-save-optim`` after ``iteration`` iterations of :data:`RUN_FLAGS`
    writes it: the model, the args, no optimizer and no scheduler. ``flags``: other values of Megatron-LM's
    arguments (by destination)."""
    os.makedirs(out, exist_ok=True)
    job, world = _job(config, tp, pp, ep, dp, kind="save", out=os.path.abspath(out), save_at=iteration,
                      optimizer=False)
    job.update(seed=seed, grouped_gemm=grouped_gemm,
               flags={**model_flags(config, grouped_gemm), **RUN_FLAGS, "no_save_optim": True, **flags})
    _spawn(job, world)


def train_mcore(out: str, config, tp: int = 1, ep: int = 1, *, dp: int = 2, iters: int = 4, save_at: int = 2,
                formats: tuple[str, ...] = ("fully_reshardable", "dp_reshardable"), init_seed: int = 1234,
                **flags: Any) -> dict[int, dict]:
    """megatron-core trains ``config``'s model (its initialisation from ``init_seed``) at tp x ep x dp on
    megazero's ``--mock-data`` samples with its distributed Adam (:mod:`tests.mcore_train`) for ``iters``
    iterations, saving after iteration ``save_at`` in each sharding type of the distributed optimizer in
    ``formats`` (into ``out/<format>``), or with ``('non_distributed',)`` its plain Adam (Megatron-LM without
    --use-distributed-optimizer) into ``out/non_distributed``. ``flags``: Megatron-LM's training arguments by
    destination (``lr``, ``micro_batch_size``, ``seed`` (the data's), ...). Returns megatron-core's metrics:
    {iteration: {lm_loss, grad_norm, lr}}."""
    import json

    distributed = formats != ("non_distributed",)
    if distributed and not set(formats) <= {"fully_reshardable", "dp_reshardable"}:
        raise ValueError(f"formats: 'fully_reshardable' and/or 'dp_reshardable', or ('non_distributed',); {formats}?")
    os.makedirs(out, exist_ok=True)
    metrics = os.path.join(os.path.abspath(out), "mcore_metrics.json")
    job, world = _job(config, tp, 1, ep, dp, kind="save", out=os.path.abspath(out), save_at=save_at, iters=iters,
                      optimizer=True, formats=tuple(formats), metrics=metrics, vocab=config.vocab_size)
    job.update(seed=init_seed, flags={**model_flags(config), "use_distributed_optimizer": distributed, **flags})
    _spawn(job, world)
    with open(metrics) as f:
        return {int(k): v for k, v in json.load(f).items()}


def mcore_logits(path: Union[str, list[str]], config, tokens: torch.Tensor, tp: int = 1, pp: int = 1, ep: int = 1,
                 *, grouped_gemm: bool = False) -> Union[torch.Tensor, list[torch.Tensor]]:
    """megatron-core loads ``path`` (a top dir with the tracker, or an ``iter_`` dir) strictly into its GPTModel
    at tp x pp x ep and returns the eval logits of ``tokens`` [b, s]: [b, s, padded_vocab] fp32 on CPU. A list
    of paths (checkpoints of one model) is read by the same processes, one after the other: a list of logits."""
    paths = [path] if isinstance(path, str) else list(path)
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "logits.pt")
        job, world = _job(config, tp, pp, ep, 1, kind="logits", paths=[os.path.abspath(p) for p in paths],
                          tokens=tokens.long().cpu(), result=result)
        job["grouped_gemm"] = grouped_gemm
        _spawn(job, world)
        logits = torch.load(result)
        return logits[0] if isinstance(path, str) else logits


def mcore_parameter_names(configs: list, *, grouped_gemm: bool = False) -> list[list[str]]:
    """megatron-core's ``named_parameters()`` names of each config's GPTModel (local spec, one rank), in order."""
    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "names.pt")
        job, world = _job(configs[0], 1, 1, 1, 1, kind="names", configs=list(configs), result=result)
        job["grouped_gemm"] = grouped_gemm
        _spawn(job, world)
        return torch.load(result)
