"""pretrain_gpt.py with multi-token prediction (--mtp-num-layers) at several layouts, compared with the
one-process run of the same flags: the LM loss, each depth's MTP loss and the grad norm per iteration
within 2e-5 (fp32, dropout 0); packed documents (the shifted tokens never cross one); and at factor 0 the
LM losses of the run without MTP."""

from __future__ import annotations

import pytest

from tests.training.test_layout_invariance import RTOL, data, flags, launch  # noqa: F401

MTP = ("--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
       "--untie-embeddings-and-output-weights", "--mtp-num-layers", "2", "--mtp-loss-scaling-factor", "0.3")
# Packed documents: per-document positions and attention, the loss of EOD targets masked, so the valid
# targets differ between micro-batches and data-parallel ranks (the MTP loss is normalised globally).
PACKED = ("--reset-position-ids", "--reset-attention-mask", "--eod-mask-loss")
KEYS = ("lm_loss", "mtp_1_loss", "mtp_2_loss", "grad_norm")


def _same(got: dict, ref: dict, what: str) -> None:
    assert sorted(got) == sorted(ref), what
    for it in ref:
        for key in KEYS:
            a, b = got[it][key], ref[it][key]
            assert abs(a - b) <= RTOL * abs(b), f"{what}: iteration {it} {key} {a} vs one process {b}"


@pytest.fixture(scope="module")
def one_process_run(data, tmp_path_factory):  # noqa: F811
    out = tmp_path_factory.mktemp("mtp1")
    return launch(1, flags(data, *MTP, *PACKED), out, "mtp1"), out


@pytest.fixture(scope="module")
def one_process(one_process_run):
    return one_process_run[0]


@pytest.mark.parametrize("world,extra", [
    (2, []),  # dp 2: each rank's own valid-target counts
    (2, ["--pipeline-model-parallel-size", "2"]),  # MTP on the last stage, with its own copy of the embedding
    (2, ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2"]),  # interleaved
    (2, ["--tp", "2", "--sequence-parallel"]),
    (2, ["--context-parallel-size", "2", "--cp-comm-type", "p2p"]),  # shifted tokens across the CP boundary
    (4, ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "--pipeline-model-parallel-size", "2"]),
    (2, ["--zero-stage", "3"]),
])
def test_mtp_equals_one_process(data, one_process, tmp_path, world, extra):  # noqa: F811
    got = launch(world, flags(data, *MTP, *PACKED, *extra), tmp_path, "mtp")
    _same(got, one_process, f"MTP world {world} {extra}")
    assert all(r["mtp_1_loss"] > 0 and r["mtp_2_loss"] > 0 for r in one_process.values())


def test_mtp_log_line_beside_the_lm_loss(one_process_run):
    text = (one_process_run[1] / "mtp1.log").read_text()
    line = next(x for x in text.splitlines() if "iteration        1/" in x)
    assert "| lm loss: " in line and "| mtp_1 loss: " in line and "| mtp_2 loss: " in line, line


def test_mtp_factor_zero_leaves_the_lm_losses_unchanged(data, tmp_path):  # noqa: F811
    i = MTP.index("--mtp-num-layers")
    without = MTP[:i] + MTP[i + 4:]  # the two MTP flags with their values
    ref = launch(1, flags(data, *without, *PACKED), tmp_path, "no_mtp")
    got = launch(2, flags(data, *without, *PACKED, "--mtp-num-layers", "1", "--mtp-loss-scaling-factor", "0",
                          "--pipeline-model-parallel-size", "2"), tmp_path, "mtp_zero")
    for it in ref:
        for key in ("lm_loss", "grad_norm"):
            assert abs(got[it][key] - ref[it][key]) <= RTOL * abs(ref[it][key]), (it, key, got[it][key], ref[it][key])
