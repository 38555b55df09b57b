"""GPTConfig: the typed description of a GPT, plus named presets.

One config describes the model for every tensor-parallel size: all sizes here
are *full* (unsharded) sizes, and ``validate(tp_size)`` checks that they split
evenly. The default field values give the GPT-2/GPT-3 architecture (learned
positions, LayerNorm, GeLU, biases, tied embeddings); ``rope`` + ``rmsnorm`` +
``swiglu`` + ``add_bias_linear=False`` (+ ``num_query_groups``) give Llama's.

Sizes follow Megatron-LM, so a Megatron launch script builds the same shapes: the SwiGLU
FFN default is ``int(4h * 2/3 / 64) * 64`` and the vocabulary is padded to a multiple of
``make_vocab_size_divisible_by * vocab_padding_tp`` (Megatron pads by ``divisible_by * tp``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch

from megazero.mpu.utils import pad_vocab_size

from .attention.pattern import check_pattern, layer_window
from .layer_pattern import (HYBRID_SYMBOLS, LayerKinds, check_layer_pattern, hybrid_segments, hybrid_symbols,
                            linear_attention_layer)
from .config_checks import check_glu, check_mla, check_moe, check_mtp, check_recurrent, check_rope_scaling

__all__ = ["GPTConfig", "PRESETS", "gpt_preset"]

_ENUMS = {
    "position_embedding_type": ("learned", "rope", "none"),
    "normalization": ("layernorm", "rmsnorm"),
    "activation": ("gelu", "swiglu", "squared_relu", "quick_geglu"),
    "init_method": ("normal", "xavier_uniform"),
    "recompute_granularity": (None, "full", "selective"),
    "recompute_method": ("uniform", "block"),
    "attention_backend": ("auto", "flash", "sdpa", "math"),
}


@dataclass
class GPTConfig:
    """Architecture and execution options of a GPT (decoder-only transformer)."""

    # --- shape -----------------------------------------------------------------------------
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int  # the tokenizer's vocabulary; the embedding is padded to padded_vocab_size
    # FFN inner size. None -> 4*hidden; for swiglu Megatron-LM's rule int(4h * 2/3 / 64) * 64
    # (10880 at h=4096; Llama itself uses 11008 there: set ffn_hidden_size to match a checkpoint).
    ffn_hidden_size: Optional[int] = None
    # Key/value heads. None -> num_attention_heads (multi-head attention); fewer -> GQA.
    num_query_groups: Optional[int] = None
    # Per-head dimension (Megatron's --kv-channels). None -> hidden_size // num_attention_heads;
    # set, heads * kv_channels may differ from hidden_size. The resolved value is ``head_dim``.
    kv_channels: Optional[int] = None
    max_position_embeddings: int = 2048  # rows of the learned position table
    seq_length: int = 2048  # training sequence length
    # --- architecture ----------------------------------------------------------------------
    position_embedding_type: str = "learned"  # 'learned' | 'rope' | 'none' (no position signal but causality)
    rotary_base: float = 10000.0  # RoPE theta
    # Fraction of each head's dimensions that RoPE rotates (the first int(d * pct)); the rest
    # pass through unrotated (Megatron's --rotary-percent, GPT-NeoX's rotary_pct).
    rotary_percent: float = 1.0
    normalization: str = "layernorm"  # 'layernorm' | 'rmsnorm'
    # 'gelu' (tanh approximation, = HF gelu_new) | 'swiglu' | 'squared_relu' (relu(x)^2, Primer) | 'quick_geglu'
    # (gpt-oss's: quick_gelu(gate) * up, quick_gelu(x) = x * sigmoid(1.702 x)). The gated two take fc1 as [gate; up].
    activation: str = "gelu"
    # Gated units only (Megatron-core's glu_linear_offset and activation_func_clamp_value): act(gate) * (up +
    # offset), after clamping gate to <= clamp and up to [-clamp, clamp] (gpt-oss: offset 1, clamp 7).
    glu_linear_offset: float = 0.0
    activation_func_clamp_value: Optional[float] = None
    # A norm (of kind ``normalization``, over the head dimension) on every query and key head
    # before RoPE (Megatron's --qk-layernorm).
    qk_layernorm: bool = False
    # Norm weights stored as (gamma - 1) and initialised to zero, so weight decay pulls gamma
    # towards 1 rather than 0 (Megatron's --apply-layernorm-1p). The function is unchanged.
    apply_layernorm_1p: bool = False
    add_bias_linear: bool = True  # biases on every linear layer (QKV, proj, MLP)
    add_qkv_bias: bool = False  # a bias on the QKV projection alone (Megatron's --add-qkv-bias, Qwen2's)
    tie_embeddings: bool = True  # output layer reuses the input embedding matrix
    # The Hugging Face model_type an export writes where two describe this network alike ('mistral' beside
    # 'llama'); None: the one the architecture picks (interop/hf.py). The HF import records it.
    hf_model_type: Optional[str] = None
    # --- which keys attention sees (attention/pattern.py; Megatron-core's names) -------------------------
    # A sliding window (left, right), Transformer Engine's convention: a query at i sees the keys i-left ..
    # i+right (a GPT: right 0; HF's sliding_window W is (W-1, 0)). None: every layer sees its whole context.
    window_size: Optional[tuple[int, int]] = None
    # Which layers slide: None, all; N, every layer but the N-th ones (1-based); or one 1/0 per layer.
    window_attn_skip_freq: Union[None, int, tuple[int, ...]] = None
    # 'vanilla' | 'off-by-one' (a zero logit in every softmax) | 'learnable' (a learned sink logit per head)
    softmax_type: str = "vanilla"
    # --- mixture of experts (Megatron-core's names; moe.py) -----------------------------------
    num_experts: Optional[int] = None  # None: dense MLPs
    moe_router_topk: int = 2
    moe_ffn_hidden_size: Optional[int] = None  # None: ffn_hidden_size
    # layer i is a mixture of experts when i % freq == 0; or a pattern, one 0/1 per layer (Megatron's
    # "([0]*3+[1]*58)": DeepSeek-V3's three dense layers first)
    moe_layer_freq: Union[int, tuple[int, ...]] = 1
    # 'aux_loss' (Switch's, per micro-batch) | 'seq_aux_loss' (per sequence, DeepSeek-V2's) | 'none'
    moe_router_load_balancing_type: str = "aux_loss"
    moe_aux_loss_coeff: float = 0.0
    moe_z_loss_coeff: float = 0.0
    # True: softmax over all experts, then the top k (weights not renormalised, Qwen2-MoE); False:
    # the top k logits, then their softmax (Mixtral).
    moe_router_pre_softmax: bool = False
    # Token dropping: each expert takes at most ceil(k T / E * factor) of the T tokens' copies a rank
    # routes (its micro-batch, gathered over TP), by routing weight ('probs') or order ('position').
    moe_router_score_function: str = "softmax"  # 'softmax' | 'sigmoid' (DeepSeek-V3)
    moe_router_num_groups: Optional[int] = None  # group-limited routing: expert groups ...
    moe_router_group_topk: Optional[int] = None  # ... and how many of them a token may use
    moe_router_topk_scaling_factor: Optional[float] = None  # the routing weights times this
    moe_router_dtype: str = "fp32"  # 'fp32' | 'fp64': the router's logits, scores and losses
    # DeepSeek-V3's auxiliary-loss-free balancing: a per-expert bias added to the scores that choose the
    # experts (not to the weights), moved by this rate against each expert's load once per step.
    moe_router_enable_expert_bias: bool = False
    moe_router_bias_update_rate: float = 1e-3
    # A learned bias on the router's logits, x W_r^T + b (gpt-oss's; megatron-core's TopKRouter has one when
    # add_bias_linear), initialised as the router's weight.
    moe_router_bias: bool = False
    # The experts' matmuls as torch._grouped_mm over the stacked weights of a rank's experts (fp32/bf16/fp16
    # where the build has it and the widths are 16-byte aligned), else an exact per-expert loop.
    moe_grouped_gemm: bool = False
    moe_expert_capacity_factor: Optional[float] = None
    moe_token_drop_policy: str = "probs"
    # With a capacity: each rank sends every expert a fixed number of rows (its kept copies, then zeros),
    # so the all-to-all's sizes are known without reading the routing on the host.
    moe_pad_expert_input_to_capacity: bool = False
    moe_min_capacity: int = 0  # an expert's capacity is at least this many copies (DeepSpeed-MoE's min_capacity)
    moe_eval_capacity_factor: Optional[float] = None  # the factor in evaluation (None: the training one)
    # Shared experts (Qwen2-MoE, DeepSeek): an MLP of this width every token passes through beside its
    # routed experts, its output scaled by sigmoid(x w_gate) when moe_shared_expert_gate.
    moe_shared_expert_intermediate_size: Optional[int] = None
    moe_shared_expert_gate: bool = False
    # --- multi-latent attention (DeepSeek-V2/V3; Megatron-core's MLATransformerConfig names) ----------------
    # Queries and keys/values pass through low-rank latents; each head's query/key is a part without
    # position (qk_head_dim) and a RoPE part (qk_pos_emb_head_dim) whose key is one per token, shared by
    # all heads; values are v_head_dim wide. num_query_groups and kv_channels do not apply.
    multi_latent_attention: bool = False
    q_lora_rank: Optional[int] = None  # None: queries projected straight from h (Moonlight, DeepSeek-V2-Lite)
    kv_lora_rank: int = 512
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    # The epsilon of the two latent norms (q_layernorm, kv_layernorm). None: layernorm_epsilon (Megatron's);
    # DeepSeek's checkpoints keep 1e-6 there whatever their other norms take.
    latent_layernorm_epsilon: Optional[float] = None
    # --- linear attention and state-space layers (Megatron-core's names; layer_pattern.py) --------------------
    # One symbol per layer (Nemotron-H's): M Mamba-2, G Gated DeltaNet, * attention, - MLP, E mixture of experts,
    # | a pipeline cut. None: every layer is attention (or Gated DeltaNet, below) and an MLP.
    hybrid_layer_pattern: Optional[str] = None
    # The mixer of the layers linear_attention_freq picks: 'gated_delta_net' (Gated DeltaNet, Qwen3-Next's) or 'kda'
    # (Kimi Delta Attention, Kimi Linear's: a decay per key channel)
    experimental_attention_variant: Optional[str] = None
    # N: every layer but each N-th (1-based) is Gated DeltaNet / KDA (Qwen3-Next, Kimi Linear: 4); or 1 / 0 per layer
    linear_attention_freq: Union[None, int, tuple[int, ...]] = None
    linear_conv_kernel_dim: int = 4  # the short causal convolution of GDN, KDA and Mamba-2 (width)
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32  # KDA: as many as the key heads
    # KDA's decay (f) and output-gate (g) projections: None a full-rank hidden -> heads x dim projection (Megatron's
    # default), else through a rank of that size (Kimi Linear: linear_key_head_dim, its f_a/f_b and g_a/g_b)
    kda_f_lora_rank: Optional[int] = None
    kda_gate_lora_rank: Optional[int] = None
    # Mamba-2: heads of mamba_head_dim channels (None: 2 * hidden_size / mamba_head_dim, Megatron's expand 2), a
    # state of mamba_state_dim per channel, B and C shared by the heads of each of mamba_num_groups groups.
    mamba_num_heads: Optional[int] = None
    mamba_head_dim: int = 64
    mamba_state_dim: int = 128
    mamba_num_groups: int = 8
    # How Gated DeltaNet and Mamba-2 run context-parallel: 'state_passing' (each rank its tokens, the ranks
    # exchange per-layer state summaries whose size does not grow with the sequence) or 'a2a' (Megatron's: an
    # all-to-all gives each rank the whole sequence for 1/cp of the heads)
    linear_cp_comm_type: str = "state_passing"
    # Attention output times sigmoid of a per-head gate projected with the queries (Qwen3-Next's gated attention)
    attention_output_gate: bool = False
    # --- RoPE scaling ----------------------------------------------------------------------------------
    # 'rope' | 'yarn' (Peng et al. 2023, DeepSeek's form). None: 'yarn' with multi-latent attention (as
    # Megatron), else 'rope'. YaRN stretches the frequencies below beta_slow rotations over the original
    # context by rotary_scaling_factor, keeps those above beta_fast, and scales the tables by
    # mscale(factor, mscale) / mscale(factor, mscale_all_dim); the softmax scale is multiplied by
    # mscale(factor, mscale_all_dim)^2, with mscale(f, m) = 0.1 m ln f + 1 (1 for f <= 1).
    # 'llama3' (Llama 3.1's, transformers' _compute_llama3_parameters and Megatron's --use-rope-scaling): the
    # frequencies whose wavelength exceeds original_max_position_embeddings / low_freq_factor are divided by
    # rotary_scaling_factor, those shorter than original / high_freq_factor kept, the ones between blended.
    rope_type: Optional[str] = None
    rotary_scaling_factor: float = 1.0
    original_max_position_embeddings: int = 4096
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    # YaRN's correction range rounded to whole dimensions (DeepSeek's); False: fractional (gpt-oss, HF truncate)
    yarn_correction_range_round_to_int: bool = True
    # --- multi-token prediction (DeepSeek-V3; Megatron's --mtp-num-layers) ------------------------------
    # D extra modules after the last layer; module k predicts token t+k+1 from module k-1's hidden states
    # and the embedding of token t+k, sharing the embedding and the output head. Their mean cross-entropy
    # times mtp_loss_scaling_factor / D joins the loss.
    mtp_num_layers: int = 0
    mtp_loss_scaling_factor: float = 0.1
    # --- regularisation and init -----------------------------------------------------------
    hidden_dropout: float = 0.1  # on embeddings and on each residual branch
    attention_dropout: float = 0.1  # on attention probabilities
    # Where dropout masks come from. 'stream': torch's generator over the tensor a rank holds and the
    # attention kernels' own (Megatron's way; masks change with the layout). 'position': a function of
    # (sample, token index in the sequence, feature, site) for hidden dropout and of (sample, global
    # head, query index, key index, layer) for attention dropout (keyed_dropout.py), the same at every
    # layout; attention then runs the explicit formula in tiles instead of the fused kernels.
    dropout_rng: str = "stream"
    init_method_std: float = 0.02  # N(0, std); residual-output projections use std/sqrt(2*layers)
    # 'normal': N(0, init_method_std) as above. 'xavier_uniform': every weight matrix (embeddings
    # too, as Megatron's --init-method-xavier-uniform) from U(+-sqrt(6 / (fan_in + fan_out))) of
    # its full (unsharded) shape, so the result does not depend on tp.
    init_method: str = "normal"
    layernorm_epsilon: float = 1e-5  # epsilon of every norm (Megatron's --norm-epsilon)
    label_smoothing: float = 0.0  # of the training loss, over the unpadded vocabulary (Megatron's --label-smoothing)
    make_vocab_size_divisible_by: int = 128
    # Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by * tp. Set this
    # to the run's tp to get Megatron's shape (GPT-2 at tp 4: 50688); 1 keeps the embedding shape
    # the same at every tp. Any tp dividing the padded size can load the weights.
    vocab_padding_tp: int = 1
    # --- execution -------------------------------------------------------------------------
    # Megatron 2022 sequence parallelism: norms/dropout/residuals on [s/tp, b, h] shards.
    # With tp=1 it is accepted and is a no-op.
    sequence_parallel: bool = False
    # Keep the residual stream (embeddings output, each residual sum) in fp32 when the weights
    # are fp16/bf16 (Megatron's --fp32-residual-connection); a no-op for fp32 weights.
    fp32_residual_connection: bool = False
    # Megatron's fp16 overflow guard: scale QK^T by 1/layer_number and undo it inside an fp32
    # softmax. megazero's attention already takes its softmax in fp32 (sdpa/flash accumulate in
    # fp32, the math path upcasts), so this is accepted for compatibility and is numerically a
    # no-op: results are identical with and without it.
    apply_query_key_layer_scaling: bool = False
    recompute_granularity: Optional[str] = None  # None | 'full' (whole layers) | 'selective' (core attention)
    recompute_method: str = "uniform"  # 'uniform': chunks of recompute_num_layers; 'block': first N layers only
    recompute_num_layers: int = 1
    attention_backend: str = "auto"  # 'auto' | 'flash' | 'sdpa' | 'math'
    # Keep each attention's largest logit per head over a step's training forwards (for QK-clip and
    # its log, Megatron's --qk-clip / --log-max-attention-logit); one extra QK^T, without gradient.
    track_max_attention_logit: bool = False
    params_dtype: torch.dtype = torch.float32

    # ---- resolved sizes -------------------------------------------------------------------

    @property
    def padded_vocab_size(self) -> int:
        """Vocabulary rounded up to ``make_vocab_size_divisible_by * vocab_padding_tp`` (Megatron's rule
        when ``vocab_padding_tp`` is the run's tp). validate() checks it divides by the running tp."""
        return pad_vocab_size(self.vocab_size, self.vocab_padding_tp, self.make_vocab_size_divisible_by)

    @property
    def ffn_size(self) -> int:
        """Resolved FFN inner size (see ``ffn_hidden_size``)."""
        if self.ffn_hidden_size is not None:
            return self.ffn_hidden_size
        if self.activation == "swiglu":
            # Megatron-LM (arguments.py): 2/3 of the 4h MLP so the gated MLP has ~ the same
            # parameters, rounded *down* to a multiple of 64.
            return int((4 * self.hidden_size * 2 / 3) / 64) * 64
        return 4 * self.hidden_size

    @property
    def gated_linear_unit(self) -> bool:
        """Whether the MLP is gated, act(gate) * up, its fc1 ``[gate; up]`` (Megatron-core's name)."""
        return self.activation in ("swiglu", "quick_geglu")

    @property
    def head_dim(self) -> int:
        """Resolved per-head dimension (``kv_channels``, default hidden // heads)."""
        return self.kv_channels if self.kv_channels is not None else self.hidden_size // self.num_attention_heads

    @property
    def rotary_dim(self) -> int:
        """How many leading dimensions of each head RoPE rotates."""
        return int(self.head_dim * self.rotary_percent)

    @property
    def resolved_rope_type(self) -> str:
        """'rope', 'yarn' or 'llama3' (``rope_type``, or its default: 'yarn' under multi-latent attention with RoPE)."""
        if self.rope_type is not None:
            return self.rope_type
        return "yarn" if self.multi_latent_attention and self.position_embedding_type == "rope" else "rope"

    @property
    def latent_norm_epsilon(self) -> float:
        """The epsilon of multi-latent attention's latent norms (``latent_layernorm_epsilon`` or the model's)."""
        return self.layernorm_epsilon if self.latent_layernorm_epsilon is None else self.latent_layernorm_epsilon

    @property
    def mamba_heads(self) -> int:
        """Resolved Mamba-2 head count (``mamba_num_heads``, default 2 * hidden_size / mamba_head_dim)."""
        return self.mamba_num_heads if self.mamba_num_heads is not None else 2 * self.hidden_size // self.mamba_head_dim

    @property
    def qk_dim(self) -> int:
        """Width of one query/key head in the attention's dot product (MLA: no-position + RoPE parts)."""
        return self.qk_head_dim + self.qk_pos_emb_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def v_dim(self) -> int:
        """Width of one value head."""
        return self.v_head_dim if self.multi_latent_attention else self.head_dim

    @property
    def query_groups(self) -> int:
        """Resolved number of key/value heads."""
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads

    # ---- checks -----------------------------------------------------------------------------

    @property
    def moe_ffn_size(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_size

    def validate(self, tp_size: int = 1) -> "GPTConfig":
        """Raise ValueError (naming the clashing numbers) if this config cannot run at ``tp_size``."""
        for name, allowed in _ENUMS.items():
            value = getattr(self, name)
            if value not in allowed:
                raise ValueError(f"{name}={value!r} is not one of {allowed}")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length",
                     "max_position_embeddings", "make_vocab_size_divisible_by", "recompute_num_layers",
                     "vocab_padding_tp"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if tp_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {tp_size}")
        h, n, g = self.hidden_size, self.num_attention_heads, self.query_groups
        if self.kv_channels is None and h % n:
            raise ValueError(f"hidden_size ({h}) must be divisible by num_attention_heads ({n}) "
                             f"(or set kv_channels, the per-head dimension)")
        if self.kv_channels is not None and self.kv_channels < 1:
            raise ValueError(f"kv_channels must be >= 1, got {self.kv_channels}")
        if g < 1 or n % g:
            raise ValueError(f"num_attention_heads ({n}) must be divisible by num_query_groups ({g})")
        if n % tp_size:
            raise ValueError(f"num_attention_heads ({n}) must be divisible by the tensor parallel size ({tp_size})")
        if g % tp_size:
            raise ValueError(f"num_query_groups ({g}) must be divisible by the tensor parallel size ({tp_size}); "
                             f"lower tp or raise num_query_groups")
        if self.ffn_size < 1 or self.ffn_size % tp_size:
            raise ValueError(f"ffn size ({self.ffn_size}) must be divisible by the tensor parallel size ({tp_size})")
        if self.padded_vocab_size % tp_size:
            raise ValueError(
                f"padded vocabulary ({self.padded_vocab_size} = {self.vocab_size} rounded up to a multiple of "
                f"make_vocab_size_divisible_by={self.make_vocab_size_divisible_by} x vocab_padding_tp="
                f"{self.vocab_padding_tp}) must be divisible by the tensor parallel size ({tp_size}); "
                f"set vocab_padding_tp={tp_size} (Megatron's padding) or a make_vocab_size_divisible_by "
                f"that is a multiple of {tp_size}")
        if self.position_embedding_type == "learned" and self.seq_length > self.max_position_embeddings:
            raise ValueError(f"seq_length ({self.seq_length}) exceeds max_position_embeddings "
                             f"({self.max_position_embeddings}) of the learned position table")
        if self.position_embedding_type == "rope":
            if not 0.0 < self.rotary_percent <= 1.0:
                raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
            if self.rotary_dim < 2 or self.rotary_dim % 2:
                raise ValueError(f"RoPE needs an even number of rotated dimensions, got {self.rotary_dim} "
                                 f"(kv_channels={self.head_dim} x rotary_percent={self.rotary_percent})")
        elif self.rotary_percent != 1.0:
            raise ValueError(f"rotary_percent={self.rotary_percent} needs position_embedding_type='rope', "
                             f"got {self.position_embedding_type!r}")
        for name in ("hidden_dropout", "attention_dropout", "label_smoothing"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {p}")
        check_glu(self)
        if self.num_experts is not None:
            check_moe(self, tp_size)
        elif self.moe_router_bias:
            raise ValueError("moe_router_bias is the router's: it needs num_experts (a mixture of experts)")
        if self.multi_latent_attention:
            check_mla(self)
        check_rope_scaling(self)
        check_mtp(self)
        check_layer_pattern(self.hybrid_layer_pattern, self.num_layers, self.experimental_attention_variant,
                            self.linear_attention_freq)
        check_recurrent(self, tp_size)
        check_pattern(self.window_size, self.window_attn_skip_freq, self.num_layers, self.softmax_type,
                      self.attention_backend)
        if self.dropout_rng not in ("stream", "position"):
            raise ValueError(f"dropout_rng must be 'stream' or 'position', got {self.dropout_rng!r}")
        if self.init_method_std <= 0:
            raise ValueError(f"init_method_std must be > 0, got {self.init_method_std}")
        if self.layernorm_epsilon <= 0:
            raise ValueError(f"layernorm_epsilon must be > 0, got {self.layernorm_epsilon}")
        if self.recompute_granularity == "full" and self.recompute_num_layers > self.num_layers:
            raise ValueError(f"recompute_num_layers ({self.recompute_num_layers}) exceeds num_layers ({self.num_layers})")
        return self

    def layer_window(self, number: int) -> Optional[int]:
        """How many keys before it a query of layer ``number`` (its index in the whole model) sees; None: all.
        A multi-token prediction depth (``number >= num_layers``) is built as the last layer: its window too."""
        return layer_window(self.window_size, self.window_attn_skip_freq, min(number, self.num_layers - 1))

    def attention_kind(self, number: int) -> str:
        """The attention builder's name of an attention layer (layer_spec.MIXER_BUILDERS): 'mla' or 'standard'."""
        return "mla" if self.multi_latent_attention else "standard"

    def layer_kinds(self, number: int) -> LayerKinds:
        """Layer ``number``'s mixer and MLP (layer_pattern.py). A multi-token prediction depth (``number >=
        num_layers``) is an attention layer with the model's MLP (a mixture when any layer has one)."""
        if number >= self.num_layers:
            return LayerKinds(self.attention_kind(number), "moe" if self.num_experts else "dense")
        if self.hybrid_layer_pattern is not None:
            mixer, mlp = HYBRID_SYMBOLS[hybrid_symbols(self.hybrid_layer_pattern)[number]]
            return LayerKinds(self.attention_kind(number) if mixer == "attention" else mixer, mlp)
        linear = "kda" if self.experimental_attention_variant == "kda" else "gdn"
        mixer = linear if linear_attention_layer(self.linear_attention_freq, number) else self.attention_kind(number)
        return LayerKinds(mixer, "moe" if self.is_moe_layer(number) else "dense")

    @property
    def recurrent(self) -> bool:
        """Some layer carries a state along the sequence (Gated DeltaNet, KDA or Mamba-2)."""
        return any(self.layer_kinds(i).recurrent for i in range(self.num_layers))

    @property
    def pipeline_segments(self) -> Optional[list[int]]:
        """Layers per pipeline segment cut by the hybrid pattern's ``|`` (None: no cut, the even split)."""
        p = self.hybrid_layer_pattern
        return hybrid_segments(p) if p is not None and "|" in p else None

    def is_moe_layer(self, number: int) -> bool:
        """Layer ``number`` (its index in the whole model) is a mixture of experts."""
        if self.hybrid_layer_pattern is not None and number < self.num_layers:
            return self.layer_kinds(number).mlp == "moe"
        f = self.moe_layer_freq
        return bool(self.num_experts) and bool(f[number] if isinstance(f, (tuple, list)) else number % f == 0)

    def replace(self, **changes: Any) -> "GPTConfig":
        """A copy with some fields changed."""
        return dataclasses.replace(self, **changes)

    # ---- (de)serialisation ------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """JSON-friendly dict (dtype as its name, e.g. 'float32')."""
        d = dataclasses.asdict(self)
        d["params_dtype"] = str(self.params_dtype).replace("torch.", "")
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "GPTConfig":
        """Inverse of ``to_dict``; unknown keys are an error (they would be silently ignored otherwise)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {unknown}; valid fields: {sorted(names)}")
        d = dict(d)
        if isinstance(d.get("params_dtype"), str):
            d["params_dtype"] = getattr(torch, d["params_dtype"].replace("torch.", ""))
        for name in ("moe_layer_freq", "window_size", "window_attn_skip_freq", "linear_attention_freq"):
            if isinstance(d.get(name), list):  # JSON keeps a tuple as a list
                d[name] = tuple(d[name])
        return cls(**d)


def _round_up(x: int, multiple: int) -> int:
    return ((x + multiple - 1) // multiple) * multiple


_GPT3 = dict(seq_length=2048, max_position_embeddings=2048, vocab_size=50257)

# Named shapes (kwargs for GPTConfig). GPT-3 sizes follow Brown et al. 2020, Table 2.1.
# 'gpt-tiny' is for tests and smoke runs; it keeps the default dropout of 0.1.
PRESETS: dict[str, dict[str, Any]] = {
    "gpt-tiny": dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=64,
                     max_position_embeddings=64, vocab_size=512),
    "gpt-125m": dict(num_layers=12, hidden_size=768, num_attention_heads=12, **_GPT3),
    "gpt-350m": dict(num_layers=24, hidden_size=1024, num_attention_heads=16, **_GPT3),
    "gpt-760m": dict(num_layers=24, hidden_size=1536, num_attention_heads=16, **_GPT3),
    "gpt-1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, **_GPT3),
    "gpt-2.7b": dict(num_layers=32, hidden_size=2560, num_attention_heads=32, **_GPT3),
    "gpt-6.7b": dict(num_layers=32, hidden_size=4096, num_attention_heads=32, **_GPT3),
    "gpt-13b": dict(num_layers=40, hidden_size=5120, num_attention_heads=40, **_GPT3),
    "gpt-175b": dict(num_layers=96, hidden_size=12288, num_attention_heads=96, **_GPT3),
}


def gpt_preset(name: str, **overrides: Any) -> GPTConfig:
    """GPTConfig of a named preset ('gpt-1.3b' or '1.3b'), with fields overridden by keyword."""
    key = name.lower()
    if key not in PRESETS:
        key = "gpt-" + key
    if key not in PRESETS:
        raise ValueError(f"unknown GPT preset {name!r}; valid names: {', '.join(PRESETS)} (the 'gpt-' prefix is optional)")
    return GPTConfig(**{**PRESETS[key], **overrides})
