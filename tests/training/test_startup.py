"""The 13B dry run's start-up figures follow from what each rank owns."""

from pathlib import Path

import pytest

from megazero.model import gpt_preset, num_parameters
from megazero.observe.startup import replicated_parameters
from megazero.observe.startup import estimate_startup, measure_rates
from tests import background

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "azure" / "run_gpt_13b.sh"


def test_per_rank_bytes_and_values_for_13b_on_64_gpus():
    c = gpt_preset("gpt-13b", vocab_size=50257)
    total, rep = num_parameters(c), replicated_parameters(c)
    z3 = estimate_startup(c, tp=4, dp=16, zero_stage=3, read_gbps_per_rank=1.0, fs_gbps=40.0, sha256_gbps=1.0,
                          init_values_per_s=100e6)
    shard = (total - rep) // 4 + rep
    assert z3.owned_parameters == -(-shard // 16) and z3.drawn_values == z3.owned_parameters
    assert z3.resume_bytes == 12 * z3.owned_parameters
    assert 2.3e9 < z3.resume_bytes < 2.5e9  # ~154 GB of masters + moments over 64 ranks
    # 64 ranks x 2.4 GB through 40 GB/s dominates one rank's 1 GB/s; hashing adds 2.4 s.
    assert z3.load_seconds == pytest.approx(z3.resume_bytes * 64 / 40e9 + z3.resume_bytes / 1e9)
    assert z3.init_seconds == pytest.approx(z3.owned_parameters / 100e6)
    z1 = estimate_startup(c, tp=4, dp=16, zero_stage=1, init_values_per_s=100e6)
    assert z1.drawn_values == shard and z1.resume_bytes == z3.resume_bytes  # ZeRO-1 replicates the compute weights


def test_measured_rates_are_plausible():
    sha, rate = measure_rates(0.05)
    assert 0.05 < sha < 50 and 5e6 < rate < 5e9


def test_dry_run_reports_startup():
    # the same run as tests/training/test_memory.py's 64-GPU plan (tests/background.py: one run per session)
    proc = background.run(["bash", str(SCRIPT), "--dry-run"], {"NNODES": "8", "REHEARSE": "0"}, timeout=120).result()
    assert proc.returncode == 0, proc.stderr
    text = proc.stdout + proc.stderr
    assert "start-up per rank (64 ranks)" in text and "resume: reads 2.42 GB" in text and "fresh start: draws" in text
