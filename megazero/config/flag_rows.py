"""The flag table's rows for DeepSeek-style models: mixtures of experts (Megatron-core's and DeepSpeed-MoE's flags),
multi-latent attention, RoPE scaling (YaRN) and multi-token prediction. ``flags`` calls these where the rows
belong in its table; each ``g(status, names, meaning, type, **kw)`` adds one row (see ``flags.Flag``)."""

from __future__ import annotations

import argparse
import re
from typing import Any, Callable

__all__ = ["add_moe_rows", "add_mla_rows", "refuse", "accept"]

H, M, R = "honoured", "mapped", "refused"
_DS_MOE = "DeepSpeed-MoE (Megatron-DeepSpeed): "
_NEEDS_MLA = "; needs --multi-latent-attention (a value other than the default is refused without it)"
_YARN = "; YaRN only (a value other than this default without YaRN is refused)"
_ONE_BALANCING = ("several load-balancing losses at once (a type and a weight each, Megatron's lists) do not exist in "
                  "megazero: give one --moe-router-load-balancing-type and one --moe-aux-loss-coeff")


def _lower(s: str) -> str:
    return s.lower()


def accept(g: Callable[..., Any], meaning: str, switches: str = "", values: str = "", type=str) -> None:
    """Mapped rows accepted with no effect (``meaning`` ends in "accepted"): the ``switches`` as one row, the
    ``values`` (flags that take one value of ``type``) as another."""
    assert meaning.endswith("accepted"), meaning
    if switches.split():
        g(M, tuple(switches.split()), meaning)
    if values.split():
        g(M, tuple(values.split()), meaning, type)


def refuse(g: Callable[..., Any], message: str, switches: str = "", values: str = "") -> None:
    """One refused row per flag, all with ``message``: ``switches`` take no value, ``values`` take the words that
    follow them (one or more in Megatron), so that a refused flag stops the run with its message, never as an
    unexpected word."""
    for name in switches.split():
        g(R, name, message)
    for name in values.split():
        g(R, name, message, str, nargs="*")


def _layer_freq(s: str):
    """``--moe-layer-freq``, ``--window-attn-skip-freq``, ``--linear-attention-freq``: an int, or Megatron's
    expression of a 0/1 list ("([0]*3+[1]*58)", "[1,0,1,0]", "([1]*3+[0])*12"), read without eval: sums of
    ``[a, b, ...]`` lists and parenthesised sums, each repeated by ``*n``."""
    text = s.replace(" ", "")
    if text.isdigit():
        return int(text)
    tokens = re.findall(r"\d+|[][(),+*]", text)
    if not text or "".join(tokens) != text:
        raise argparse.ArgumentTypeError(f"{s!r}: give an int or a list of 0/1 per layer such as ([0]*3+[1]*58)")
    values, end = _sum(tokens, 0, s)
    if end != len(tokens):
        raise argparse.ArgumentTypeError(f"{s!r}: unexpected {''.join(tokens[end:])!r} after the list")
    return tuple(values)


def _sum(tokens: list[str], i: int, original: str) -> tuple[list[int], int]:
    """``term (+ term)*`` from ``tokens[i]``: the list and the index after it."""
    out, i = _term(tokens, i, original)
    while i < len(tokens) and tokens[i] == "+":
        more, i = _term(tokens, i + 1, original)
        out += more
    return out, i


def _term(tokens: list[str], i: int, original: str) -> tuple[list[int], int]:
    """``[a, b, ...]`` or ``( sum )``, then any ``*n``."""
    bad = argparse.ArgumentTypeError(f"{original!r}: each term is [0/1, ...], [0/1, ...]*n or ( ... )*n")
    if i < len(tokens) and tokens[i] == "(":
        out, i = _sum(tokens, i + 1, original)
        if i >= len(tokens) or tokens[i] != ")":
            raise bad
        i += 1
    elif i < len(tokens) and tokens[i] == "[":
        out, i = [], i + 1
        while i < len(tokens) and tokens[i] != "]":
            if not tokens[i].isdigit() or tokens[i + 1:i + 2] not in ([","], ["]"]):
                raise bad
            out.append(int(tokens[i]))
            i += 2 if tokens[i + 1] == "," else 1
        if i >= len(tokens):
            raise bad
        i += 1
    else:
        raise bad
    while i + 1 < len(tokens) and tokens[i] == "*" and tokens[i + 1].isdigit():
        out, i = out * int(tokens[i + 1]), i + 2
    return out, i


def add_moe_rows(g: Callable[..., Any]) -> None:
    """The mixture-of-experts rows (group "model")."""
    g(H, "--num-experts", "experts of each mixture-of-experts layer (dense MLPs without it); one value (Megatron-"
      "DeepSpeed's per-layer list is refused)", int, nargs="+")
    g(H, "--moe-router-topk", "experts each token is routed to (default 2; 1 with DeepSpeed-MoE's flags)", int)
    g(M, "--topk", _DS_MOE + "--moe-router-topk (its default 1; top-1 weighs by the softmax over all experts, as "
      "DeepSpeed's gate)", int, dest="ds_topk")
    g(H, ("--expert-model-parallel-size", "--ep"), "expert-parallel size: each rank holds num_experts / ep experts "
      "of every MoE layer, tokens reach them by all-to-all; ep x --expert-tensor-parallel-size divides the ranks of "
      "a pipeline stage, over the rest of which (expert data parallel) ZeRO partitions the experts (default 1)", int, dest="expert_model_parallel_size")
    g(M, "--moe-expert-parallel-size", _DS_MOE + "--expert-model-parallel-size", int, dest="ds_moe_expert_parallel_size")
    g(H, "--expert-tensor-parallel-size", "tensor parallelism of the experts (default --tp): each expert's weights are "
      "sharded over this many ranks; ep x etp divides the ranks of a pipeline stage (tp x dp x cp), laid out etp "
      "fastest, then ep, then expert data parallel (Megatron-core's order). Other than --tp it needs "
      "--sequence-parallel when tp > 1", int)
    g(H, "--moe-ffn-hidden-size", "hidden size of each expert's MLP (default --ffn-hidden-size)", int)
    g(H, "--moe-layer-freq", "every n-th layer is a mixture of experts (layer i when i % n == 0), or a pattern of "
      "0 (dense) and 1 (experts), one per layer, in Megatron's form: \"([0]*3+[1]*58)\"", _layer_freq, default=1)
    g(H, "--moe-router-load-balancing-type", "aux_loss (Switch's load-balancing loss over each micro-batch), "
      "seq_aux_loss (the same per sequence, averaged: independent of how the global batch is split) or none",
      _lower, choices=("aux_loss", "none", "seq_aux_loss", "sinkhorn", "global_aux_loss", "quantile_balancing"),
      default="aux_loss", several=_ONE_BALANCING, refuse_values=tuple(
          (v, f"--moe-router-load-balancing-type {v} is not available in megazero; use aux_loss, seq_aux_loss or "
              "none") for v in ("sinkhorn", "global_aux_loss", "quantile_balancing")))
    g(H, "--moe-aux-loss-coeff", "weight of the load-balancing loss (its gradient is added in backward, scaled as "
      "the language-model loss; default 0)", float, several=_ONE_BALANCING)
    g(M, "--moe-loss-coeff", _DS_MOE + "--moe-aux-loss-coeff (its default 0.1)", float, dest="ds_moe_loss_coeff")
    g(H, "--moe-z-loss-coeff", "weight of the router z-loss (mean logsumexp of the logits, squared)", float, default=0.0)
    g(H, "--moe-router-pre-softmax", "softmax over all experts before the top k (weights not renormalised, "
      "Qwen2-MoE); without it the softmax is over the k chosen logits (Mixtral)")
    g(H, "--moe-token-dispatcher-type", "alltoall; allgather is mapped to it (the same tokens reach the same "
      "experts)", _lower, choices=("alltoall", "allgather", "flex"), default="alltoall",
      refuse_values=(("flex", "--moe-token-dispatcher-type flex (DeepEP) is not available; use alltoall"),))
    g(H, "--moe-grouped-gemm", "the experts' matmuls as grouped matmuls (torch._grouped_mm over a rank's experts: "
      "bf16 on Hopper/Blackwell GPUs, any float dtype on the CPU; 16-byte aligned widths), the same bits as the "
      "per-expert loop used otherwise; the experts' biases (without --disable-bias-linear) added to their rows "
      "after each")
    g(M, "--disable-moe-token-dropping", _DS_MOE + "dropless (without it DeepSpeed-MoE drops by capacity)",
      dest="ds_disable_moe_token_dropping")
    g(H, "--moe-expert-capacity-factor", "token dropping: each expert takes at most ceil(k T / E x factor) of the "
      "k T token copies of a data-parallel rank's micro-batch (decided over its T tokens, gathered over TP and CP in "
      "one process's order), the rest are dropped (their output 0); the same tokens are dropped at every tp, sp, cp, "
      "ep and etp", float)
    g(H, "--moe-token-drop-policy", "which copies an expert keeps: probs (the highest routing weights, ties to the "
      "earlier token) or position (the earliest)", _lower, choices=("probs", "position"), default="probs")
    g(H, "--moe-pad-expert-input-to-capacity", "with --moe-expert-capacity-factor: each rank sends every expert "
      "min(capacity, its tokens) rows, its kept copies then zero rows, so the all-to-all's sizes are known without "
      "waiting for the device (no host synchronisation per MoE layer); the experts compute the zero rows too")
    g(M, "--moe-train-capacity-factor", _DS_MOE + "--moe-expert-capacity-factor (its default 1.0, dropping unless "
      "--disable-moe-token-dropping)", float, dest="ds_moe_train_capacity_factor")
    g(M, "--moe-eval-capacity-factor", _DS_MOE + "the capacity factor in evaluation (default the training one)", float,
      dest="ds_moe_eval_capacity_factor")
    g(M, "--moe-min-capacity", _DS_MOE + "the least capacity of an expert whatever the factor (its default 4)", int,
      dest="ds_moe_min_capacity")
    g(R, "--moe-token-dropping", "DeepSpeed-MoE's switch: use --moe-expert-capacity-factor (dropless without it)")
    g(H, "--moe-shared-expert-intermediate-size", "width of the shared expert every token passes through beside its "
      "routed ones (Qwen2-MoE, DeepSeek)", int)
    g(H, "--moe-shared-expert-gate", "scale the shared expert's output by sigmoid(x w) (Qwen2-MoE's shared_expert_gate)")
    g(H, "--moe-router-score-function", "softmax, or sigmoid (DeepSeek-V3: the top k sigmoids renormalised)", _lower,
      choices=("softmax", "sigmoid", "sqrtsoftplus"), default="softmax",
      refuse_values=(("sqrtsoftplus", "--moe-router-score-function sqrtsoftplus does not exist in megazero; use "
                                      "softmax or sigmoid"),))
    g(H, "--moe-router-num-groups", "group-limited routing (DeepSeek): the experts in this many groups", int)
    g(H, "--moe-router-group-topk", "group-limited routing: the groups a token's experts may come from, those whose "
      "best top-k / group-topk experts score highest", int)
    g(H, "--moe-router-topk-scaling-factor", "the routing weights times this (DeepSeek-V3's routed scaling factor)", float)
    g(H, "--moe-router-dtype", "the router's precision: fp32, or fp64 (tie-safe routing for layout comparisons)",
      _lower, choices=("fp32", "fp64"), default="fp32")
    g(H, "--moe-router-enable-expert-bias", "DeepSeek-V3's auxiliary-loss-free balancing (sigmoid routing): a bias per "
      "expert added to the scores that choose the experts, moved once per step by --moe-router-bias-update-rate "
      "against the expert's load over the global batch; checkpointed")
    g(H, "--moe-router-bias-update-rate", "how far the expert bias moves per step", float, default=1e-3)
    g(M, "--expert-interval", _DS_MOE + "every n-th layer a mixture, from layer n-1 (its default 2): a "
      "--moe-layer-freq pattern", int, dest="ds_expert_interval")
    g(M, "--mlp-type", _DS_MOE + "standard; residual (PR-MoE) is refused", _lower, dest="ds_mlp_type",
      refuse_values=(("residual", "--mlp-type residual (DeepSpeed's PR-MoE: a dense MLP beside each expert) is not "
                      "available; use --mlp-type standard, or Megatron's shared experts (--moe-shared-expert-"
                      "intermediate-size)"),))
    g(M, "--create-moe-param-group", _DS_MOE + "accepted: ZeRO already keeps the experts in groups of their own "
      "(partitioned over expert data parallel)", dest="ds_create_moe_param_group")
    g(M, "--disable-moe-top2-2nd-expert-sampling", _DS_MOE + "accepted: megazero takes the second expert by its "
      "score, never by sampling", dest="ds_disable_top2_sampling")
    g(M, ("--moe-permute-fusion", "--moe-router-fusion"), "fused token permutation / router kernels: megazero computes "
      "these steps unfused (PyTorch ops, the same function); accepted")
    g(R, "--moe-flex-dispatcher-backend", "the flex dispatcher (DeepEP, HybridEP) is not available; use "
      "--moe-token-dispatcher-type alltoall and drop the flag", str)
    g(R, "--moe-router-force-load-balancing", "routing every token to experts in turn, whatever the router says "
      "(a benchmarking mode), is not available; drop the flag")


def add_mla_rows(g: Callable[..., Any]) -> None:
    """The multi-latent attention, RoPE-scaling and multi-token prediction rows (their own group)."""
    g(H, "--multi-latent-attention", "DeepSeek-V2/V3's multi-latent attention: queries through a --q-lora-rank latent (or "
      "straight from the hidden state), keys and values through a --kv-lora-rank latent, each query/key head a "
      "--qk-head-dim part without position and a --qk-pos-emb-head-dim RoPE part (the key's one per token, shared by the "
      "heads), values --v-head-dim wide; needs --qk-layernorm and --position-embedding-type rope. As in Megatron, "
      "--num-query-groups and --kv-channels have no effect on it (a start-up note says so) and --group-query-attention "
      "is refused beside it; RoPE defaults to --rope-type yarn")
    g(H, "--q-lora-rank", "rank of the query latent; not given or 0: queries projected straight from the hidden state "
      "(DeepSeek-V2-Lite, Moonlight)" + _NEEDS_MLA, int)
    g(H, "--kv-lora-rank", "rank of the key/value latent (Megatron's flag default, not MLATransformerConfig's 512)"
      + _NEEDS_MLA, int, default=32)
    g(H, "--qk-head-dim", "per-head query/key dimensions without position" + _NEEDS_MLA, int, default=128)
    g(H, "--qk-pos-emb-head-dim", "per-head query/key dimensions RoPE rotates (even)" + _NEEDS_MLA, int, default=64)
    g(H, "--v-head-dim", "per-head value dimensions" + _NEEDS_MLA, int, default=128)
    g(H, "--rope-type", "rope, or yarn (YaRN, DeepSeek's form); default yarn with --multi-latent-attention, else rope. "
      "yarn without --multi-latent-attention is refused, as Megatron asserts: use --position-embedding-type yarn",
      _lower, choices=("rope", "yarn"))
    g(H, "--rotary-scaling-factor", "YaRN's context extension: frequencies below --yarn-beta-slow rotations over the "
      "original context are stretched by this factor (DeepSeek-V3: 40); an explicit --rope-type yarn or "
      "--position-embedding-type yarn needs it given" + _YARN, float, default=1.0)
    g(H, "--mscale", "YaRN's scale of the rotary tables: mscale(factor, this) / mscale(factor, --mscale-all-dim), "
      "mscale(f, m) = 0.1 m ln f + 1" + _YARN, float, default=1.0)
    g(H, "--mscale-all-dim", "YaRN: the softmax scale times mscale(factor, this)^2" + _YARN, float, default=0.0)
    g(H, "--yarn-original-max-position-embeddings", "YaRN: the context the model was trained at before the "
      "extension. Megatron reads the --yarn-* flags for --position-embedding-type yarn only (its multi-latent "
      "attention keeps 4096, 32 and 1); megazero applies them to both, with the same defaults" + _YARN, int,
      dest="original_max_position_embeddings", default=4096)
    g(H, "--yarn-beta-fast", "YaRN: frequencies above this many rotations over the original context are kept"
      + _YARN, float, dest="beta_fast", default=32.0)
    g(H, "--yarn-beta-slow", "YaRN: frequencies below this many rotations are interpolated" + _YARN, float,
      dest="beta_slow", default=1.0)
    g(H, "--yarn-correction-range-round-to-int", "YaRN's correction range rounded to whole dimensions (DeepSeek's "
      "form, Megatron's default)")
    g(H, "--no-yarn-correction-range-round-to-int", "YaRN's correction range left fractional (gpt-oss's, HF's "
      "truncate: false)", dest="yarn_correction_range_round_to_int", store_false=True)
    g(M, "--mla-down-proj-fusion", "the query and key/value down projections as one matmul: megazero computes them apart "
      "(the same function); accepted")
    g(R, "--cache-mla-latents", "caching the latents for flash-MLA decoding is an inference feature megazero's training "
      "does not have; drop the flag")
    g(H, "--mtp-num-layers", "multi-token prediction (DeepSeek-V3): D modules after the last layer, module k predicting "
      "token t+k+1 from module k-1's hidden states and token t+k's embedding, on the last pipeline stage; needs "
      "--position-embedding-type rope or none (as Megatron) and --seq-length > D", int, default=0)
    g(H, "--mtp-loss-scaling-factor", "weight of the modules' mean cross-entropy in the loss (a value other than this "
      "default without --mtp-num-layers is refused)", float, default=0.1)
