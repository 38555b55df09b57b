"""The command-line surface as data: every flag, what it means in Megatron, and what megazero does with it.

One row per flag. ``build_parser`` (in ``arguments``) makes argparse from these rows,
``refusals`` turns every refused flag (or refused value) found on a command line into
one message naming the megazero way, and ``flag_docs.flags_markdown`` writes docs/flags.md, so
the code and the documentation cannot drift (tests/scripts/test_scripts_parse.py checks the
file against the table).

Status of a row:

- ``honoured``: megazero implements Megatron's meaning.
- ``mapped``: Megatron's intent is met by a megazero mechanism of another name (the
  row says which): ``--use-distributed-optimizer`` is ZeRO-1, ``--checkpoint-activations``
  is ``--recompute-granularity full``, a ``--no-*-fusion`` flag asks for the unfused
  computation, which is the only one megazero has.
- ``refused``: stops the run before any process group starts, with the message given.

A row may also refuse some *values* of an otherwise honoured flag (``refuse_values``), name the only
values megazero has (``only``, Megatron's default among them) and refuse every other, or take one value
where Megatron takes a list and refuse several (``several``).

Every flag of Megatron-LM's newest ``arguments.py`` has a row (tests/training/test_megatron_flags.py holds the
table against the list in tests/training/megatron_lm_flags.txt). The groups are built here in order; rows kept
elsewhere: ``flag_rows`` (mixtures of experts, multi-latent attention), ``flag_rows_training`` (batch, schedule,
optimizer), ``flag_rows_hybrid`` (Mamba-2 and Gated DeltaNet layers), ``flag_rows_mcore`` (Megatron-core's newer
flags in megazero's groups) and ``flag_rows_absent`` (the Megatron-LM features megazero does not have, in groups
of their own).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megazero.config import flag_rows_mcore as mcore
from megazero.config.flag_rows import add_mla_rows, add_moe_rows
from megazero.config.flag_rows_absent import NO_TE, add_absent_groups
from megazero.config.flag_rows_hybrid import add_hybrid_rows
from megazero.config.flag_rows_training import add_optimizer_rows, add_schedule_rows

__all__ = ["Flag", "FLAGS", "HONOURED", "MAPPED", "REFUSED", "HELP_EPILOG", "refusals",
           "add_to_parser"]

HONOURED, MAPPED, REFUSED = "honoured", "mapped", "refused"


@dataclass(frozen=True)
class Flag:
    names: tuple[str, ...]
    status: str
    meaning: str  # Megatron's meaning and megazero's handling (or the refusal message for REFUSED)
    group: str
    type: Optional[Callable[[str], Any]] = None  # None: a switch (store_true / store_false)
    nargs: Optional[Any] = None
    choices: Optional[tuple] = None
    dest: Optional[str] = None
    store_false: bool = False  # a '--no-x' switch writing False into the dest of '--x'
    refuse_values: tuple[tuple[Any, str], ...] = ()  # (value, message) pairs refused for an honoured flag
    metavar: Optional[str] = None
    # The value in force when the flag is not given, as --help and docs/flags.md show it (None: none to
    # show, e.g. it comes from the data or the preset). The parser's own default stays None.
    default: Any = None
    only: Optional[tuple] = None  # the values megazero has: any other value is refused with the meaning
    several: Optional[str] = None  # a flag Megatron gives several values and megazero one: why more are refused

    @property
    def attr(self) -> str:
        return self.dest or self.names[0].lstrip("-").replace("-", "_")

    @property
    def in_help(self) -> bool:
        """False for the flags --help leaves to docs/flags.md: refused ones, and mapped ones accepted with
        no effect (their meaning ends in "accepted"). Both still parse, so a refusal still explains itself."""
        return not (self.status == REFUSED or (self.status == MAPPED and self.meaning.endswith("accepted")))

    def argparse_kwargs(self) -> dict[str, Any]:
        if self.several is not None:  # one value, or a list that ``refusals`` refuses
            return dict(dest=self.attr, default=None, type=self.type, choices=self.choices, metavar=self.metavar,
                        nargs="+", action=_OneOfSeveral)
        if self.type is None and self.nargs is None:
            return dict(action="store_false" if self.store_false else "store_true", default=None, dest=self.attr)
        kw: dict[str, Any] = dict(dest=self.attr, default=None)
        if self.type is not None:
            kw["type"] = self.type
        for key in ("nargs", "choices", "metavar"):
            if getattr(self, key) is not None:
                kw[key] = getattr(self, key)
        return kw


class _OneOfSeveral(argparse.Action):
    """A flag given one value stores it; given several, the list (refused by ``refusals``)."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, values[0] if len(values) == 1 else list(values))


def _lower(s: str) -> str:
    return s.lower()


_ROWS: list[Flag] = []


def _row(group: str, status: str, names, meaning: str, type=None, **kw) -> None:
    names = (names,) if isinstance(names, str) else tuple(names)
    if status == REFUSED and len(names) > 1:  # one row each, so the message names the flag the user wrote
        for name in names:
            _ROWS.append(Flag(names=(name,), status=status, meaning=meaning, group=group, type=type, **kw))
        return
    _ROWS.append(Flag(names=names, status=status, meaning=meaning, group=group, type=type, **kw))


def _group(name: str):
    def add(status, names, meaning, type=None, **kw):
        _row(name, status, names, meaning, type, **kw)
    return add


H, M, R = HONOURED, MAPPED, REFUSED

# ------------------------------------------------------------------------------------------- launcher
g = _group("launcher and parallelism")
g(M, ("--local_rank", "--local-rank"), "rank on this node, passed by the `deepspeed` launcher and "
  "`torch.distributed.launch`; megazero reads LOCAL_RANK from the environment and refuses a value that disagrees",
  int, dest="local_rank")
g(H, ("--tensor-model-parallel-size", "--tp"), "tensor-parallel size", int, dest="tp", default=1)
g(H, ("--pipeline-model-parallel-size", "--pp"), "pipeline-parallel size: each of pp stages holds a contiguous "
  "block of layers (the embedding on the first, final norm and head on the last), trained with 1F1B "
  "(PipeDream-Flush); world = tp x cp x pp x dp (expert parallelism divides the ranks of a stage, no factor "
  "of its own)", int, dest="pp", default=1)
g(H, ("--virtual-pipeline-model-parallel-size", "--num-virtual-stages-per-pipeline-rank"), "model chunks per "
  "pipeline rank (interleaved 1F1B, Narayanan et al. "
  "2021): bubble (pp-1)/(v m) instead of (pp-1)/m, for v times more p2p messages; micro-batches per step must be a "
  "multiple of pp", int, dest="virtual_pipeline_model_parallel_size", default=1)
g(H, "--num-layers-per-virtual-pipeline-stage", "interleaved 1F1B given as layers per model chunk: v = num_layers / "
  "(pp x this)", int)
g(R, "--pipeline-model-parallel-layout", "a per-chunk layout string is not available: give the layers of the "
  "first and last stages with --decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers (and "
  "--virtual-pipeline-model-parallel-size for chunks); the embedding sits on the first stage, the head and the "
  "multi-token prediction modules on the last", str)
g(H, "--decoder-first-pipeline-num-layers", "layers of the first pipeline stage (Megatron-core's uneven split; "
  "the other stages share the rest evenly)", int)
g(H, "--decoder-last-pipeline-num-layers", "layers of the last pipeline stage (Megatron-core's uneven split)", int)
g(H, ("--context-parallel-size", "--cp"), "context-parallel size: each sequence is split over cp ranks in 2 x cp "
  "balanced chunks (rank r holds chunks r and 2cp-1-r) and attention runs over the whole sequence "
  "(--cp-comm-type); parameters are replicated over cp and ZeRO partitions over dp x cp; world = tp x cp x pp x dp",
  int, dest="context_parallel_size", default=1)
g(H, "--cp-comm-type", "how context-parallel attention exchanges: p2p (a ring of K/V blocks, overlapped with the "
  "block computation), a2a (all-to-all over heads, DeepSpeed Ulysses), allgather (K/V gathered) or a2a+p2p "
  "(all-to-all inside groups of --hierarchical-context-parallel-sizes' first size, the ring across them); one "
  "value for every layer, or one per layer", dest="cp_comm_type", nargs="+", default=None)
g(H, "--hierarchical-context-parallel-sizes", "a2a+p2p's two levels: the all-to-all group size (consecutive "
  "context-parallel ranks, within a node) and the ring size; their product is --context-parallel-size",
  int, nargs="+")
g(H, "--sequence-parallel", "Megatron 2022 sequence parallelism: activations outside attention and the MLP "
  "sharded over the tensor-parallel ranks (off at --tp 1, as Megatron-LM turns it off)")
g(H, "--zero-stage", "ZeRO stage 0-3 over the data-parallel group (Megatron-DeepSpeed)", int, default=1)
g(M, "--use-distributed-optimizer", "Megatron's distributed optimizer (optimizer states sharded over data "
  "parallel) is ZeRO stage 1: sets --zero-stage 1 unless a stage >= 1 is given; --zero-stage 0 beside it is refused")
g(M, "--overlap-grad-reduce", "overlap the gradient reduction with backward: megazero's ZeRO always does "
  "(zero_optimization.overlap_comm, reduce-scatter per unit as backward leaves it)")
g(M, "--overlap-param-gather", "overlap the parameter all-gather with forward: megazero's ZeRO-3 prefetches one "
  "unit ahead; at stages 1/2 the post-step all-gather is not overlapped (a speed difference only)")
g(H, "--distributed-backend", "torch.distributed backend (nccl needs CUDA; gloo runs on CPU)", str,
  choices=("nccl", "gloo", "ccl"), refuse_values=(("ccl", "--distributed-backend ccl (oneCCL) is not supported; "
                                                   "use nccl on GPUs or gloo on CPUs"),))
g(H, "--distributed-timeout-minutes", "timeout of every process group's collectives, and how long a rank may "
  "make no progress before every rank stops naming the ranks that did not arrive, their phase and host "
  "(megazero.training.watchdog); on NCCL its watchdog backs it up", float, default=10, metavar="MINUTES")
g(H, ("--deepspeed_config", "--deepspeed-config"), "DeepSpeed JSON: its keys are honoured, mapped, refused or "
  "ignored as listed in docs/flags.md; a value given both there and as a flag must agree", str,
  dest="deepspeed_config")
g(M, "--deepspeed", "use DeepSpeed: megazero's ZeRO engine takes its place; accepted")
g(M, "--no-pipeline-parallel", "Megatron-DeepSpeed's 'no DeepSpeed pipeline engine': pipeline size 1 (a --pp > 1 "
  "beside it is refused as a contradiction)")
g(M, ("--use-mcore-models", "--use-legacy-models"), "which of Megatron's two model implementations: megazero "
  "has one GPT implementation; accepted")
g(H, "--transformer-impl", "layer implementation: 'local' is megazero's own layers", str,
  choices=("local", "transformer_engine", "inference_optimized"),
  refuse_values=(("transformer_engine", f"--transformer-impl transformer_engine: {NO_TE}; "
                                        "pass --transformer-impl local"),
                                       ("inference_optimized", "--transformer-impl inference_optimized: Megatron's "
                                        "inference layers do not exist in megazero; pass --transformer-impl local")))
g(M, "--no-async-tensor-model-parallel-allreduce", "synchronous tensor-parallel all-reduce: megazero's is "
  "synchronous; accepted")
g(M, ("--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
      "--no-bias-dropout-fusion", "--no-bias-swiglu-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
      "--no-gradient-reduce-div-fusion"),
  "turn a fused CUDA kernel off: megazero computes these steps unfused (PyTorch ops); accepted")
g(M, "--cpu-optimizer", "Megatron-DeepSpeed's optimizer on the CPU: --optimizer-cpu-offload (the DeepSpeed JSON's "
  "offload_optimizer block, when given, says where)")
g(M, "--cpu-torch-adam", "Megatron-DeepSpeed's torch Adam instead of DeepSpeed's CPU Adam: megazero's host step is "
  "torch's fused AdamW; accepted")
mcore.add_parallel_rows(g)

# --------------------------------------------------------------------------------------------- model
g = _group("model")
g(M, "--model-preset", "megazero only: a named shape (gpt-tiny ... gpt-175b); shape flags override it", str)
for _n in ("--num-layers", "--hidden-size", "--num-attention-heads", "--ffn-hidden-size", "--max-position-embeddings"):
    g(H, _n, "model shape", int)
g(H, ("--seq-length", "--encoder-seq-length"), "tokens per sample (--encoder-seq-length: Megatron's other name of it "
  "for GPTs)", int, dest="seq_length")
g(H, "--num-query-groups", "key/value heads for grouped-query attention", int)
g(M, "--num-key-value-heads", "Megatron-DeepSpeed's name for --num-query-groups", int)
g(M, "--group-query-attention", "enable GQA: --num-query-groups alone does it; refused beside --multi-latent-attention "
  "(Megatron asserts the two exclusive); accepted")
g(H, "--kv-channels", "per-head dimension (default hidden / heads)", int)
g(H, "--position-embedding-type", "learned_absolute, rope, yarn (RoPE with YaRN scaling, Megatron's way for "
  "attention without latents) or none", str, choices=("learned_absolute", "learned", "rope", "yarn", "none", "mrope",
                                                    "relative"),
  refuse_values=tuple((v, f"--position-embedding-type {v}: {what} does not exist in megazero; use rope, yarn or "
                          "learned_absolute") for v, what in (("mrope", "multimodal RoPE"),
                                                              ("relative", "T5's relative position bias"))))
g(M, "--use-rotary-position-embeddings", "Megatron-DeepSpeed's --position-embedding-type rope")
g(M, "--no-position-embedding", "no learned position table: --position-embedding-type none, or beside rope nothing "
  "more")
g(H, "--rotary-base", "RoPE theta", float, default=10000.0)
g(H, "--rotary-percent", "fraction of each head's dimensions rotated by RoPE", float, default=1.0)
g(H, "--normalization", "LayerNorm or RMSNorm", _lower, choices=("layernorm", "rmsnorm"))
g(H, ("--norm-epsilon", "--layernorm-epsilon"), "epsilon of every norm", float, dest="norm_epsilon", default=1e-05)
g(H, "--apply-layernorm-1p", "LayerNorm with weight stored as (1 + w), zero-centred")
g(H, "--qk-layernorm", "normalize queries and keys per head; with --multi-latent-attention: the norms of the query and "
  "key/value latents (Megatron's q_layernorm/kv_layernorm), which megazero's multi-latent attention always has, so "
  "there it is required")
g(H, "--swiglu", "SwiGLU MLP; without --ffn-hidden-size Megatron's size int(4h*2/3 / 64) * 64")
g(H, "--squared-relu", "squared-ReLU MLP activation")
g(H, "--disable-bias-linear", "no biases on linear layers")
g(H, "--untie-embeddings-and-output-weights", "a separate output layer")
g(H, "--init-method-std", "N(0, std) initialization", float, default=0.02)
g(H, "--label-smoothing", "label smoothing of the training loss, over the unpadded vocabulary", float, default=0.0)
g(H, "--init-method-xavier-uniform", "Xavier-uniform initialization")
g(M, "--use-cpu-initialization", "initialize on CPU so weights do not depend on the GPU layout: megazero's "
  "initialization already gives the same values at every tp x dp layout; accepted")
g(H, "--fp32-residual-connection", "keep the residual stream in fp32")
g(M, ("--apply-query-key-layer-scaling",), "Megatron's 1/layer scaling of QK^T undone inside an fp32 softmax "
  "(numerically the identity up to fp16 rounding); passed to the model as apply_query_key_layer_scaling",
  dest="apply_query_key_layer_scaling")
g(M, "--no-query-key-layer-scaling", "see --apply-query-key-layer-scaling", dest="apply_query_key_layer_scaling",
  store_false=True)
g(M, "--attention-softmax-in-fp32", "megazero's attention softmax is always computed in fp32; accepted")
g(H, ("--hidden-dropout",), "dropout on embeddings and residual branches", float, default=0.1)
g(H, "--attention-dropout", "dropout on attention probabilities", float, default=0.1)
g(H, "--dropout-rng", "where dropout masks come from: 'stream' (torch's generator over each rank's tensor and the "
  "attention kernels' own, as Megatron; masks change with the layout) or 'position' (hidden dropout a function of "
  "sample, token index, feature and site, attention dropout of sample, global head, query and key index and layer: "
  "the same at every layout; attention with dropout then runs the explicit formula in tiles, not flash). Default: "
  "stream at every --context-parallel-size", _lower, choices=("stream", "position"))
g(H, "--make-vocab-size-divisible-by", "pad the vocabulary to a multiple of this x tensor-parallel size (GPT-2 "
  "at tp 4: 50688); a resume keeps the padded size of the checkpoint in --load", int, default=128)
g(H, "--attention-backend", "attention kernel: auto, flash (flash-attn), fused (PyTorch SDPA), unfused/local "
  "(PyTorch math)", _lower, choices=("auto", "flash", "fused", "unfused", "local"), default="auto")
g(M, ("--use-flash-attn", "--use-flash-attn-v2"), "--attention-backend flash", dest="use_flash_attn")
g(H, "--add-qkv-bias", "a bias on the query/key/value projection only (Qwen2's)")
add_moe_rows(g)
mcore.add_moe_rows_newer(g)
mcore.add_model_rows(g)

# ------------------------------------------------------------------- multi-latent attention, YaRN, MTP
g = _group("multi-latent attention, RoPE scaling and multi-token prediction")
add_mla_rows(g)
mcore.add_mtp_rows_newer(g)

# ------------------------------------------------------------------ Mamba-2 and Gated DeltaNet layers
g = _group("hybrid models: Mamba-2 and Gated DeltaNet layers")
add_hybrid_rows(g)

# ---------------------------------------------------------------------------------------- recompute
g = _group("activation recompute")
g(H, "--recompute-granularity", "full (whole layers) or selective (core attention)", str,
  choices=("full", "selective"))
g(H, "--recompute-method", "uniform or block", str, choices=("uniform", "block"), default="uniform")
g(H, "--recompute-num-layers", "layers per recompute chunk (uniform) or recomputed layers (block)", int, default=1)
g(H, "--recompute-modules", "what selective recompute recomputes: core_attn (Megatron's default), the one module "
  "megazero's selective recompute has; others (mlp, moe, moe_act, shared_experts, layernorm, mla_up_proj) are "
  "refused, with --recompute-granularity full as the way to recompute them", str, nargs="+")
g(M, "--checkpoint-activations", "Megatron-DeepSpeed's --recompute-granularity full")
g(M, "--recompute-activations", "Megatron's --recompute-granularity selective")
g(M, "--checkpoint-num-layers", "Megatron-DeepSpeed's --recompute-num-layers", int)
g(M, "--deepspeed-activation-checkpointing", "use DeepSpeed's checkpointing implementation for recompute: "
  "megazero's RNG-correct checkpoint (megazero.mpu.random) is the one used; alone it recomputes nothing, as in "
  "Megatron-DeepSpeed")
g(R, "--partition-activations", "partitioning checkpointed activations across tensor-parallel ranks does not "
  "exist in megazero; use --sequence-parallel, which shards activations over the tensor-parallel group")
g(R, "--contigious-checkpointing", "contiguous buffers for partitioned activations only work with "
  "--partition-activations, which megazero does not implement; drop both (--sequence-parallel shards "
  "activations instead)")
g(R, ("--checkpoint-in-cpu", "--synchronize-each-layer", "--profile-backward"),
  "DeepSpeed activation-checkpointing internals that megazero does not have; drop the flag")
mcore.add_recompute_rows(g)

# ------------------------------------------------------------------------------------- batch/schedule
g = _group("batch and schedule")
add_schedule_rows(g)
mcore.add_schedule_rows(g)

# ------------------------------------------------------------------------------------------ optimizer
g = _group("optimizer and precision")
add_optimizer_rows(g)
mcore.add_precision_rows(g)

# ----------------------------------------------------------------------------------------------- data
g = _group("data and tokenizer")
_NO_TOKENIZERS = ("BertWordPieceLowerCase", "BertWordPieceCase", "TikTokenizer", "MultimodalTokenizer",
                  "NullMultimodalTokenizer", "SFTTokenizer")
g(H, "--data-path", "PREFIX, 'P1 P2 ...' (blended by size, as megatron-core) or 'W1 P1 W2 P2 ...'", str, nargs="+")
g(H, "--train-data-path", "training data only (with --valid-data-path/--test-data-path instead of --split)",
  str, nargs="+")
g(H, "--valid-data-path", "validation data", str, nargs="+")
g(H, "--test-data-path", "test data", str, nargs="+")
g(H, "--data-cache-path", "where the sample indices are cached", str)
g(H, "--split", "train,valid,test weights", str, default="969,30,1")
g(H, "--mock-data", "synthetic tokens, no files")
g(H, "--data-impl", "dataset implementation: megazero reads .bin/.idx by mmap", str,
  choices=("mmap", "infer", "lazy", "cached"),
  refuse_values=tuple((v, f"--data-impl {v} does not exist in megazero: .bin/.idx files are read by mmap "
                          "(the same files); pass --data-impl mmap or drop the flag") for v in ("lazy", "cached")))
g(M, ("--no-mmap-bin-files", "--no-create-attention-mask-in-dataloader"), "read .bin files without mmap; no "
  "attention mask built by the data loader: megazero reads by mmap (the same tokens) and builds causal masks inside "
  "attention; accepted")
g(H, "--num-workers", "DataLoader worker processes (0: reads in the training process)", int, default=0)
g(H, "--reset-position-ids", "restart position ids after each end-of-document token")
g(H, "--reset-attention-mask", "no attention across end-of-document tokens")
g(H, "--eod-mask-loss", "no loss on end-of-document tokens")
g(H, "--tokenizer-type", "SentencePieceTokenizer, GPTSentencePieceTokenizer, Llama2Tokenizer, GPT2BPETokenizer "
  "(default, as Megatron's pretrain_gpt.py), HuggingFaceTokenizer, HFTokenizer, NullTokenizer", str,
  choices=("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer", "GPT2BPETokenizer",
           "HuggingFaceTokenizer", "HFTokenizer", "NullTokenizer") + _NO_TOKENIZERS,
  refuse_values=tuple((v, f"--tokenizer-type {v} does not exist in megazero: a GPT's tokenizers are the other "
                          "choices (HuggingFaceTokenizer reads most)") for v in _NO_TOKENIZERS))
g(H, "--tokenizer-model", "SentencePiece model file or Hugging Face tokenizer directory", str)
g(H, "--vocab-file", "GPT-2 BPE vocab.json", str)
g(H, "--merge-file", "GPT-2 BPE merges.txt", str)
g(H, "--vocab-size", "NullTokenizer's vocabulary; with other tokenizers an override", int)
g(H, "--vocab-extra-ids", "extra sentinel tokens added to the tokenizer", int, default=0)

mcore.add_data_rows(g)

# ---------------------------------------------------------------------------------------- checkpoints
g = _group("checkpoints and run control")
g(H, "--save", "checkpoint directory", str)
g(H, "--load", "resume from this directory", str)
g(H, ("--save-interval", "--persistent-save-interval"), "iterations between checkpoints (without --save: no "
  "checkpoints, one warning)", int, dest="save_interval")
g(M, "--pretrained-checkpoint", "megazero: initial weights from a full checkpoint (tools/convert_from_hf.py)", str)
g(H, "--finetune", "load only the weights from --load; iteration, samples, optimizer and RNG start afresh")
g(H, "--no-load-optim", "do not load the optimizer state (moments) from --load")
g(H, "--ckpt-step", "the iteration to load from --load instead of the latest (Megatron-LM's --ckpt-step)", int)
g(H, "--no-load-rng", "do not load the RNG states from --load")
g(R, "--no-save-optim", "megazero checkpoints always hold the optimizer partitions (they make resharded reloads "
  "exact); drop the flag, and export weights only with tools/convert_to_hf.py")
g(R, "--no-save-rng", "megazero checkpoints always hold every rank's RNG states (exact resume); drop the flag")
g(H, "--use-checkpoint-args", "the model's shape and architecture from the checkpoint in --load or "
  "--pretrained-checkpoint (Megatron's load_args_from_checkpoint); a model flag that disagrees with it is refused; "
  "every run from a checkpoint takes the settings no flag gives from it; with this flag a run without a "
  "checkpoint to take them from is refused")
g(H, ("--ckpt-format", "--dist-ckpt-format"), "checkpoint file format of --save: megazero (its own, reloads at any "
  "tp x pp x dp x ep x ZeRO stage) or torch_dist (Megatron-LM's distributed format, which megatron-core's "
  "dist_checkpointing.load reads at any tp x pp); --load reads either, and Megatron-LM's torch_dist checkpoints",
  str, choices=("megazero", "torch_dist", "torch", "zarr", "torch_dcp", "fsdp_dtensor"), default="megazero",
  refuse_values=tuple((v, f"--ckpt-format {v} is not written by megazero: use --ckpt-format torch_dist (what "
                          "Megatron-LM writes by default) or megazero") for v in ("torch", "zarr", "torch_dcp",
                                                                                   "fsdp_dtensor")))
g(H, "--async-save", "write each checkpoint in the background while training continues (at most one save in "
  "flight; the next save, the end of the run, a signal or a failure waits for it)")
g(R, ("--non-persistent-save-interval", "--non-persistent-ckpt-type", "--non-persistent-local-ckpt-dir"),
  "megazero writes no rank-local non-persistent checkpoints: save with --save-interval, and --async-save to keep "
  "training while each one is written", str)
g(M, "--use-dist-ckpt", "sharded checkpoints: megazero's checkpoints are sharded and reshardable; accepted")
g(M, "--auto-detect-ckpt-format", "find the format of --load: megazero always does, reading its own format and "
  "Megatron-LM's torch_dist alike; accepted")
g(M, "--dist-ckpt-strictness", "how a distributed checkpoint's missing or unexpected keys are handled: a megazero "
  "load refuses any mismatch, naming the keys; accepted", str)
g(H, "--no-check-for-nan-in-loss-and-grad", "turn off the check that ends the run (saving a debug checkpoint) at a "
  "loss or gradient norm that is not finite: the step is skipped, as fp16's loss scaler skips one, and training "
  "goes on", dest="check_for_nan_in_loss_and_grad", store_false=True)
g(M, ("--cross-entropy-loss-fusion", "--manual-gc", "--enable-experimental"), "a fused cross-entropy kernel, Python "
  "garbage collection at fixed intervals, Megatron's experimental features: megazero computes the cross-entropy "
  "unfused (the same function), leaves the collector alone and has no experimental switch; accepted")
g(M, "--cross-entropy-fusion-impl", "which fused cross-entropy kernel: megazero's is unfused; accepted", str,
  choices=("native", "te"))
g(M, "--manual-gc-interval", "see --manual-gc; accepted", int)
g(M, "--logging-level", "Python logging level of Megatron's loggers: megazero's log lines are fixed (rank 0's "
  "progress, every rank's warnings); accepted", int)
g(H, "--exit-interval", "save and exit when iteration % N == 0", int)
g(H, "--exit-duration-in-mins", "save and exit after this many minutes of training", float)
g(H, "--exit-signal-handler", "on SIGTERM: save a checkpoint and exit")
g(H, "--skip-train", "no training: only evaluate (validation and test) the loaded model")
g(H, "--eval-interval", "iterations between validations", int, default=1000)
g(H, "--eval-iters", "batches per validation and test evaluation", int, default=100)

mcore.add_checkpoint_rows(g)

# -------------------------------------------------------------------------------------------- logging
g = _group("logging")
g(H, "--log-interval", "iterations between log lines", int, default=100)
g(H, "--tensorboard-dir", "TensorBoard event files", str)
g(H, "--tensorboard-log-interval", "iterations between TensorBoard writes", int, default=1)
g(H, "--tensorboard-queue-size", "events queued before a flush", int, default=1000)
g(H, "--log-timers-to-tensorboard", "forward-backward / optimizer times (Megatron's '-time' tags)")
g(H, "--log-batch-size-to-tensorboard", "'batch-size' tag")
g(H, "--log-validation-ppl-to-tensorboard", "'lm loss validation ppl' tag")
g(H, "--log-memory-to-tensorboard", "the log line's peak memory as TensorBoard's 'mem-max-allocated-bytes'")
g(H, "--log-optimizer-states-to-tensorboard", "norms and max-abs of the optimizer moments "
  "(Megatron-DeepSpeed's 'optimizer/...' tags)")
g(H, "--log-params-norm", "the parameters' global norm ('params-norm')")
g(H, "--log-num-zeros-in-grad", "zeros in the gradient ('num-zeros')")
g(H, "--log-throughput", "the log line's throughput in TensorBoard: 'throughput' (TFLOP/s per rank), "
  "'tokens-per-second' and 'mfu'")
g(H, "--log-straggler", "every log interval, the slowest and fastest ranks' times per phase (data, "
  "forward-backward, optimizer step) with their rank ids, from one small gather; a warning names a rank "
  "slower than the median by --straggler-factor for 3 intervals in a row")
g(H, "--straggler-minmax-count", "how many of the slowest and of the fastest ranks --log-straggler names", int,
  default=1)
g(H, "--straggler-factor", "--log-straggler warns of a rank whose phase takes this many times the median "
  "rank's, interval after interval", float, default=1.5)
g(R, "--disable-straggler-on-startup", "megazero's --log-straggler has no runtime switch: give --log-straggler "
  "or leave it out")
g(R, "--straggler-ctrlr-port", "megazero's --log-straggler has no control server to toggle it at run time: "
  "give --log-straggler or leave it out", int)
g(M, ("--log-loss-scale-to-tensorboard", "--log-learning-rate-to-tensorboard", "--log-world-size-to-tensorboard"),
  "on by default in megazero (loss scale and learning rate are always logged); accepted")
g(H, "--wandb-project", "Weights & Biases project (needs wandb; WANDB_MODE=offline works without network)", str)
g(H, "--wandb-exp-name", "Weights & Biases run name", str)
g(H, "--wandb-save-dir", "Weights & Biases directory (default: SAVE/wandb with --save, else wandb's ./wandb)", str)
g(M, "--track-memory", "megazero: on CPU, track live tensors so the log line's memory is the step's peak "
  "(costs about 4x per op; CUDA always reports its allocator's peak)")
g(M, "--device-peak-tflops", "megazero: one device's dense peak TFLOP/s, for the log line's MFU (model FLOPs "
  "without recompute over this peak); bf16/fp16 runs on A100, H100, H200, B200 GPUs know theirs, other devices log "
  "no MFU without it", float)
g(M, "--metrics-file", "megazero: JSONL metrics (default SAVE/metrics.jsonl)", str)
g(M, "--generate-prompt", "megazero: sample from the model at the end of training", str)
g(M, "--generate-tokens", "megazero: tokens to sample", int, default=32)

mcore.add_logging_rows(g)

# ------------------------------------------------------- Megatron-LM features megazero does not have
add_absent_groups(_group)

FLAGS: tuple[Flag, ...] = tuple(_ROWS)
del _ROWS, g


HELP_EPILOG = ("Not listed above: the Megatron-LM / DeepSpeed flags megazero refuses (each stops the run with a "
               "message naming the megazero way) and those it accepts with no effect. Every flag, refused and "
               "mapped ones included, and every DeepSpeed JSON key: docs/flags.md.")


def add_to_parser(parser: argparse.ArgumentParser) -> None:
    groups: dict[str, Any] = {}
    for f in FLAGS:
        grp = groups.get(f.group) or groups.setdefault(f.group, parser.add_argument_group(f.group))
        help_text = f"[{f.status}] {f.meaning}".replace("%", "%%") + _default_text(f)
        grp.add_argument(*f.names, help=help_text if f.in_help else argparse.SUPPRESS, **f.argparse_kwargs())


def _shown(value: Any) -> str:
    """A default as a user would type it: 0.1, 1e-08, 4294967296 (no float rounding)."""
    if isinstance(value, float):
        short = f"{value:g}"
        return short if float(short) == value else str(int(value)) if value.is_integer() else repr(value)
    return str(value)


def _default_text(f: Flag) -> str:
    return "" if f.default is None else f" (default: {_shown(f.default)})"


def _given(ns: argparse.Namespace, flag: Flag) -> bool:
    return getattr(ns, flag.attr, None) is not None


def refusals(ns: argparse.Namespace) -> list[str]:
    """Messages for every refused flag or refused value present in ``ns`` (empty: nothing refused); refused flags
    that share a message share its line."""
    lines: list[tuple[list[str], str]] = []  # (refused flags given, message): flags [] for a refused value
    by_message: dict[str, list[str]] = {}
    for f in FLAGS:
        value = getattr(ns, f.attr, None)
        if value is None:
            continue
        if f.status == REFUSED:
            if f.meaning not in by_message:
                by_message[f.meaning] = []
                lines.append((by_message[f.meaning], f.meaning))
            if f.names[0] not in by_message[f.meaning]:
                by_message[f.meaning].append(f.names[0])
        lines += [([], message) for bad, message in f.refuse_values if value == bad]
        if f.several is not None and isinstance(value, list):
            lines.append(([], f"{f.names[0]} {' '.join(map(_shown, value))}: {f.several}"))
        elif f.only is not None and value not in f.only:
            lines.append(([], f"{f.names[0]} {_shown(value)}: {f.meaning}"))
    return [f"{', '.join(flags)}: {message}" if flags else message for flags, message in lines]
