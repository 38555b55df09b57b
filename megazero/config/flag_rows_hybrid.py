"""The flag table's rows for models whose layers differ in kind: Megatron-LM's hybrid stacks (Mamba-2, Gated
DeltaNet, attention and MLP layers by ``--hybrid-layer-pattern``, Nemotron-H's) and Gated DeltaNet or Kimi Delta
Attention inside a GPT (``--experimental-attention-variant gated_delta_net|kda --linear-attention-freq``, Qwen3-Next's
and Kimi Linear's). ``flags`` adds them
as a group of their own; ``resolve.hybrid`` turns them into ``GPTConfig`` fields."""

from __future__ import annotations

from typing import Any, Callable

from megazero.config.flag_rows import _layer_freq, accept

__all__ = ["add_hybrid_rows"]

H, M, R = "honoured", "mapped", "refused"
_GDN_SIZE = "Gated DeltaNet's (and KDA's) "
_MAMBA_SIZE = "Mamba-2's "


def add_hybrid_rows(g: Callable[..., Any]) -> None:
    """The rows of group "hybrid models: Mamba-2 and Gated DeltaNet layers"."""
    g(H, "--hybrid-layer-pattern", "one symbol per layer, each a pre-norm block with its own residual: M Mamba-2, "
      "G Gated DeltaNet, * attention (multi-latent with --multi-latent-attention), - MLP, E mixture of experts "
      "(needs --num-experts); | cuts the stack into pipeline stages, one segment per stage or virtual stage "
      "(segments / --pp chunks per rank). Gives --num-layers (its symbols without |), which may be left out",
      str, metavar=("PATTERN",))
    g(M, "--hybrid-override-pattern", "Megatron's older name of --hybrid-layer-pattern (the two together are "
      "refused, as Megatron asserts)", str, metavar=("PATTERN",))
    g(H, "--hybrid-attention-ratio", "without --hybrid-layer-pattern: round(layers x ratio) attention layers "
      "spread evenly among Mamba-2 layers (megatron-core's allocate_layers); beside a pattern, the pattern must have "
      "as many (Megatron's older check)", float, default=0.0)
    g(H, "--hybrid-mlp-ratio", "without --hybrid-layer-pattern: round(layers x ratio) of the Mamba-2 layers made MLPs "
      "(megatron-core's allocate_layers); beside a pattern, the pattern must have as many", float, default=0.0)
    g(M, "--is-hybrid-model", "a hybrid stack: --hybrid-layer-pattern (or the ratios of a Mamba stack --spec) gives "
      "its layers and implies it; without one it is refused")
    g(M, "--spec", "Megatron's layer-spec import path: its Mamba/hybrid stack spec (words containing mamba or "
      "hybrid, e.g. megatron.core.models.mamba.mamba_layer_specs mamba_stack_spec) is accepted, the layers coming "
      "from --hybrid-layer-pattern (without one, from --hybrid-attention-ratio and --hybrid-mlp-ratio: all Mamba-2 "
      "by default, as Megatron's pretrain_mamba.py); other specs are refused", str, nargs="*")
    g(H, "--experimental-attention-variant", "gated_delta_net (or gdn, Megatron's newer name): the layers "
      "--linear-attention-freq picks are Gated DeltaNet (Qwen3-Next's linear attention); kda: Kimi Delta Attention "
      "(Kimi Linear's: Gated DeltaNet with a decay per key channel, one value head per key head); gdn2 and dsa "
      "(DeepSeek sparse attention) do not exist in megazero", str,
      choices=("gated_delta_net", "gdn", "kda", "gdn2", "dsa"),
      refuse_values=(("gdn2", "--experimental-attention-variant gdn2 (Gated DeltaNet-2) does not exist in megazero; "
                              "use gated_delta_net"),
                     ("dsa", "--experimental-attention-variant dsa: DeepSeek sparse attention does not exist in "
                             "megazero; use gated_delta_net, or drop the flag for attention")))
    g(H, "--linear-attention-freq", "with --experimental-attention-variant gated_delta_net (or kda): N, every layer "
      "but each N-th (1-based) is Gated DeltaNet (KDA), the N-th attention (Qwen3-Next, Kimi Linear: 4); or one 1 "
      "(linear attention) or 0 (attention) per layer such as \"([1]*3+[0])*12\"", _layer_freq)
    for flag, what, default in (("--linear-conv-kernel-dim", "width of the short causal convolution of Gated "
                                 "DeltaNet, KDA and Mamba-2", 4),
                                ("--linear-key-head-dim", _GDN_SIZE + "query/key head dimension", 128),
                                ("--linear-value-head-dim", _GDN_SIZE + "value head dimension", 128),
                                ("--linear-num-key-heads", _GDN_SIZE + "query/key heads (tensor parallelism splits "
                                 "them: a multiple of --tp)", 16),
                                ("--linear-num-value-heads", _GDN_SIZE + "value heads, a multiple of "
                                 "--linear-num-key-heads (KDA: equal to it)", 32),
                                ("--mamba-head-dim", _MAMBA_SIZE + "head dimension", 64),
                                ("--mamba-state-dim", _MAMBA_SIZE + "state dimension per channel", 128),
                                ("--mamba-num-groups", _MAMBA_SIZE + "groups sharing B and C (tensor parallelism "
                                 "splits them: a multiple of --tp)", 8)):
        g(H, flag, what, int, default=default)
    for flag, what in (("--kda-f-lora-rank", "decay projection"), ("--kda-gate-lora-rank", "output-gate projection")):
        g(H, flag, f"KDA's {what} through this rank (hidden -> rank -> heads x key/value dim, bias-free; Kimi Linear: "
          "--linear-key-head-dim); without it one full-rank projection (Megatron's default)", int)
    g(H, "--mamba-num-heads", _MAMBA_SIZE + "heads (default 2 x --hidden-size / --mamba-head-dim, Megatron's expand "
      "2); a multiple of --mamba-num-groups", int)
    g(H, "--linear-cp-comm-type", "how Gated DeltaNet, KDA and Mamba-2 layers run under --context-parallel-size: "
      "state_passing (default: each rank runs its tokens; the ranks all-gather per-layer state summaries whose size "
      "does not grow with the sequence; any number of heads) or a2a (Megatron's: an all-to-all gives each rank the "
      "whole sequence for 1/cp of the heads, which must divide)", str, choices=("state_passing", "a2a"))
    g(H, "--attention-output-gate", "the attention output times the sigmoid of a gate as wide as the queries, "
      "projected with them (Qwen3-Next's gated attention); not with --multi-latent-attention")
    g(H, "--mamba-training-ssm-states-dtype", "the dtype of Mamba-2's states between chunks: megazero keeps them in "
      "fp32 (Megatron's default follows the activations); bf16 does not exist in megazero", str,
      choices=("fp32", "bf16"), only=("fp32",))
    accept(g, "Megatron's fused Mamba-2 kernel (the memory-efficient path) off: megazero computes Mamba-2 with its "
           "own kernels, the same function; accepted", "--disable-mamba-mem-eff-path")
