"""pretrain_gpt.py with a DeepSeek-V3-shaped model (multi-latent attention with a query latent and YaRN,
DeepSeek's mixture of experts: sigmoid scores, group-limited routing, expert bias, a shared expert, the
sequence-wise balance loss, a dense first layer; multi-token prediction) at layouts that combine tensor,
sequence, context, pipeline and expert parallelism with ZeRO, compared with the one-process run of the
same flags: LM loss, MTP loss and grad norm per iteration within 2e-5 (fp32, dropout 0)."""

from __future__ import annotations

import pytest

from tests.training.test_layout_invariance import RTOL, assert_resumes_elsewhere, data, flags, launch  # noqa: F401

DEEPSEEK = (
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
    "--untie-embeddings-and-output-weights",
    "--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "12", "--qk-head-dim", "8",
    "--qk-pos-emb-head-dim", "4", "--v-head-dim", "6", "--qk-layernorm",
    "--rotary-scaling-factor", "4", "--mscale", "1.0", "--mscale-all-dim", "1.0",
    "--yarn-original-max-position-embeddings", "8",
    "--num-experts", "4", "--moe-ffn-hidden-size", "16", "--moe-router-topk", "2",
    "--moe-layer-freq", "([0]*1+[1]*3)", "--moe-shared-expert-intermediate-size", "16",
    "--moe-router-score-function", "sigmoid", "--moe-router-topk-scaling-factor", "2.5",
    "--moe-router-num-groups", "2", "--moe-router-group-topk", "1",
    "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate", "1e-2",
    "--moe-router-load-balancing-type", "seq_aux_loss", "--moe-aux-loss-coeff", "1e-2",
    "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0.3",
)
KEYS = ("lm_loss", "mtp_1_loss", "grad_norm", "moe_aux_loss")


@pytest.fixture(scope="module")
def one_process(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, *DEEPSEEK), tmp_path_factory.mktemp("dsv3"), "dsv3")


@pytest.mark.parametrize("world,extra", [
    (4, ["--tp", "2", "--sequence-parallel", "--expert-model-parallel-size", "2",
         "--expert-tensor-parallel-size", "1"]),
    (4, ["--pipeline-model-parallel-size", "2", "--context-parallel-size", "2", "--cp-comm-type", "p2p"]),
    (4, ["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1",
         "--expert-model-parallel-size", "2", "--zero-stage", "3"]),  # uneven: 1 and 3 layers
    (4, ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--expert-model-parallel-size", "2",
         "--zero-stage", "2", "--recompute-granularity", "full", "--recompute-method", "uniform"]),
])
def test_deepseek_shape_equals_one_process(data, one_process, tmp_path, world, extra):  # noqa: F811
    got = launch(world, flags(data, *DEEPSEEK, *extra), tmp_path, "dsv3")
    assert sorted(got) == sorted(one_process)
    for it, ref in one_process.items():
        for key in KEYS:
            a, b = got[it][key], ref[key]
            assert abs(a - b) <= RTOL * abs(b), f"world {world} {extra}: iteration {it} {key} {a} vs one process {b}"
    assert all(r["mtp_1_loss"] > 0 and r["moe_aux_loss"] > 0 for r in one_process.values())


def test_mtp_factor_zero_reaches_nothing_of_the_main_model(data, tmp_path):  # noqa: F811
    """At --mtp-loss-scaling-factor 0 the MTP layer's cross-entropy and its own router losses (a mixture
    here) are all scaled away: the run equals the one without MTP."""
    i = DEEPSEEK.index("--mtp-num-layers")
    without = DEEPSEEK[:i] + DEEPSEEK[i + 4:]  # the two MTP flags with their values
    ref = launch(1, flags(data, *without), tmp_path, "dsv3_no_mtp")
    got = launch(4, flags(data, *without, "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0",
                          "--pipeline-model-parallel-size", "2", "--expert-model-parallel-size", "2"),
                 tmp_path, "dsv3_mtp_zero")
    for it, r in ref.items():
        for key in ("lm_loss", "grad_norm", "moe_aux_loss"):
            assert abs(got[it][key] - r[key]) <= RTOL * abs(r[key]), (it, key, got[it][key], r[key])


PACKED = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")


@pytest.fixture(scope="module")
def one_process_packed(data, tmp_path_factory):  # noqa: F811
    return launch(1, flags(data, *DEEPSEEK, *PACKED), tmp_path_factory.mktemp("dsv3_packed1"), "dsv3_packed1")


@pytest.mark.parametrize("world,extra", [
    # packed documents over the ring (the MTP shifts stop at each document), the optimizer state on the host
    (4, ["--context-parallel-size", "2", "--cp-comm-type", "p2p", "--expert-model-parallel-size", "2",
         "--zero-stage", "2", "--optimizer-cpu-offload"]),
    (4, ["--pipeline-model-parallel-size", "2", "--tp", "2", "--sequence-parallel",
         "--recompute-granularity", "selective"]),
])
def test_deepseek_shape_packed_documents_equal_one_process(data, one_process_packed, tmp_path, world,  # noqa: F811
                                                           extra):
    ref = one_process_packed
    got = launch(world, flags(data, *DEEPSEEK, *PACKED, *extra), tmp_path, "dsv3_packed")
    for it, r in ref.items():
        for key in KEYS:
            assert abs(got[it][key] - r[key]) <= RTOL * abs(r[key]), (world, extra, it, key, got[it][key], r[key])


def test_deepseek_shape_resumes_at_other_layouts(data, one_process, tmp_path):  # noqa: F811
    """Saved at pp 2 x ep 2 (the MTP layer and the embedding's copy on the last stage, the expert biases in
    the buffers), resumed in one process and at tp 2 x cp 2: iterations 3 on equal the uninterrupted run."""
    assert_resumes_elsewhere(data, list(DEEPSEEK), (4, ["--pipeline-model-parallel-size", "2",
                                                        "--expert-model-parallel-size", "2"]),
                             [(1, []), (4, ["--tp", "2", "--sequence-parallel", "--context-parallel-size", "2",
                                            "--cp-comm-type", "p2p"])], one_process, tmp_path, "dsv3")
