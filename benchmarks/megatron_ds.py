"""The Megatron-DeepSpeed arrangement, for ``zero_baselines.py --system megatron-ds``.

What a Megatron-DeepSpeed user runs today: a GPT built from megatron-core's tensor-parallel
layers (``ColumnParallelLinear`` / ``RowParallelLinear`` / ``VocabParallelEmbedding``,
``vocab_parallel_cross_entropy``; fused QKV, ``[s, b, h]`` activations, tied output
embedding as in Megatron-LM's ``parallel_lm_logits``), its groups from megatron-core's
``parallel_state``, and DeepSpeed ZeRO driving it through ``deepspeed.initialize(...,
mpu=...)``. Same shape, parameter count and FLOPs as megazero's GPT.

Needs ``megatron-core`` (``pip install megatron-core``; CPU is enough: the layers are built
with ``use_cpu_initialization``) and ``deepspeed``.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F


def _mpu_of(parallel_state) -> types.SimpleNamespace:
    """DeepSpeed's ``mpu`` names over megatron-core's ``parallel_state`` (Megatron-DeepSpeed's
    fork still has ``get_model_parallel_*``; megatron-core calls them ``tensor_model_parallel``)."""
    ps = parallel_state
    return types.SimpleNamespace(
        get_model_parallel_rank=ps.get_tensor_model_parallel_rank,
        get_model_parallel_world_size=ps.get_tensor_model_parallel_world_size,
        get_model_parallel_group=ps.get_tensor_model_parallel_group,
        get_tensor_model_parallel_rank=ps.get_tensor_model_parallel_rank,
        get_tensor_model_parallel_world_size=ps.get_tensor_model_parallel_world_size,
        get_tensor_model_parallel_group=ps.get_tensor_model_parallel_group,
        get_data_parallel_rank=ps.get_data_parallel_rank,
        get_data_parallel_world_size=ps.get_data_parallel_world_size,
        get_data_parallel_group=ps.get_data_parallel_group,
    )


def build(c, tp: int) -> tuple[torch.nn.Module, types.SimpleNamespace]:
    """The megatron-core GPT of GPTConfig ``c`` at tensor-parallel size ``tp`` (on CPU), and its mpu."""
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    config = ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True,
                                 perform_initialization=True, gradient_accumulation_fusion=False,
                                 sequence_parallel=False)
    std = 0.02
    init = lambda w: torch.nn.init.normal_(w, std=std)  # noqa: E731
    scaled = lambda w: torch.nn.init.normal_(w, std=std / math.sqrt(2 * c.num_layers))  # noqa: E731
    h, heads = c.hidden_size, c.num_attention_heads
    local_heads, head_dim = heads // tp, h // heads

    class Layer(torch.nn.Module):
        """Megatron-LM's ParallelTransformerLayer (pre-norm, fused QKV, GeLU MLP, biases)."""

        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.ln2 = torch.nn.LayerNorm(h), torch.nn.LayerNorm(h)
            self.qkv = tensor_parallel.ColumnParallelLinear(h, 3 * h, config=config, init_method=init, bias=True,
                                                            gather_output=False)
            self.proj = tensor_parallel.RowParallelLinear(h, h, config=config, init_method=scaled, bias=True,
                                                          input_is_parallel=True, skip_bias_add=False)
            self.fc1 = tensor_parallel.ColumnParallelLinear(h, 4 * h, config=config, init_method=init, bias=True,
                                                            gather_output=False)
            self.fc2 = tensor_parallel.RowParallelLinear(4 * h, h, config=config, init_method=scaled, bias=True,
                                                         input_is_parallel=True, skip_bias_add=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # [s, b, h]
            s, b, _ = x.shape
            qkv, _ = self.qkv(self.ln1(x))  # [s, b, 3 h / tp], per head [q k v]
            q, k, v = qkv.view(s, b, local_heads, 3 * head_dim).permute(1, 2, 0, 3).split(head_dim, dim=-1)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [b, nh, s, hd]
            out, _ = self.proj(a.permute(2, 0, 1, 3).reshape(s, b, local_heads * head_dim))
            x = x + out
            y, _ = self.fc1(self.ln2(x))
            out, _ = self.fc2(F.gelu(y, approximate="tanh"))
            return x + out

    class GPT(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embedding = tensor_parallel.VocabParallelEmbedding(c.padded_vocab_size, h, init_method=init,
                                                                    config=config)
            self.position = torch.nn.Embedding(c.max_position_embeddings, h)
            init(self.position.weight)
            self.layers = torch.nn.ModuleList(Layer() for _ in range(c.num_layers))
            self.ln_f = torch.nn.LayerNorm(h)

        def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            """Per-token cross-entropy ``[b, s]`` (as megazero's GPT returns it); the logits stay split
            over the vocabulary (``parallel_lm_logits``)."""
            x = self.embedding(tokens) + self.position(torch.arange(tokens.size(1)))
            x = x.transpose(0, 1).contiguous()  # [s, b, h], Megatron's layout
            for layer in self.layers:
                x = layer(x)
            x = tensor_parallel.copy_to_tensor_model_parallel_region(self.ln_f(x))
            logits = F.linear(x, self.embedding.weight)  # [s, b, vocab / tp]
            return tensor_parallel.vocab_parallel_cross_entropy(logits.float(), labels.t().contiguous()).t()

    torch.manual_seed(1234)  # one draw on every rank: use_cpu_initialization splits the full matrices
    return GPT(), _mpu_of(parallel_state)
