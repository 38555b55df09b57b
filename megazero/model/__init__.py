"""megazero.model: the GPT, built only from megazero.mpu layers.

One definition for every tensor-parallel size (exact against tp=1), with closed-form
sizes/FLOPs, TP-independent full state dicts, and Hugging Face GPT-2/Llama interop.
A training loop holds it by its face (:class:`ModelFace`: this rank's chunks, their inputs
from a batch, the step's hooks) and reads its figures by the names of ``metrics``.
"""

from .attention.self_attention import SelfAttention
from .config import PRESETS, GPTConfig, gpt_preset
from .face import ModelBatch, ModelFace
from .flops import flops_per_iteration, flops_per_token, layer_forward_flops_per_token, num_parameters
from .gpt import GPTModel, PositionEmbedding, materialize_
from .interop.hf import export_to_hf, hf_architecture, import_from_hf
from .metrics import (
                      EXPERT_LOAD_SUM,
                      LM_LOSS,
                      MOE_AUX_LOSS,
                      MOE_DROPPED_SUM,
                      MOE_LAYERS,
                      MOE_METRICS,
                      is_mtp_loss,
                      metric_names,
                      mtp_loss_name,
                      step_metrics,
)
from .mlp import MLP, GatedColumnParallelLinear
from .state_dict import (
                      gather_full_state_dict,
                      gather_full_tensor,
                      load_full,
                      load_full_state_dict,
                      save_full,
                      shard_full_tensor,
)
from .transformer import TransformerLayer

__all__ = [
    # config.py
    "GPTConfig", "PRESETS", "gpt_preset",
    # gpt.py, transformer.py
    "GPTModel", "PositionEmbedding", "materialize_", "TransformerLayer", "SelfAttention", "MLP",
    "GatedColumnParallelLinear",
    # face.py, metrics.py
    "ModelFace", "ModelBatch", "LM_LOSS", "MOE_AUX_LOSS", "EXPERT_LOAD_SUM", "MOE_LAYERS", "MOE_DROPPED_SUM",
    "MOE_METRICS", "mtp_loss_name", "is_mtp_loss", "metric_names", "step_metrics",
    # flops.py
    "num_parameters", "flops_per_iteration", "flops_per_token", "layer_forward_flops_per_token",
    # state_dict.py
    "gather_full_state_dict", "load_full_state_dict", "gather_full_tensor", "shard_full_tensor", "save_full", "load_full",
    # hf.py
    "export_to_hf", "import_from_hf", "hf_architecture",
]
