"""What the whole suite shares: the ``slow`` tier and the small training corpus.

``bash scripts/test.sh`` runs every test; ``bash scripts/test.sh --quick`` (``pytest -m "not slow"``)
leaves out the modules and tests below, which launch whole programs (``pretrain_gpt.py`` at several
layouts, the real launchers, the DeepSpeed comparison, the 13B dry runs) or cost as much: the tier
for working on one piece.
"""

from __future__ import annotations

import pytest

from tests.helpers import write_progressions

SLOW_MODULES = {
    "tests/pipeline/test_planner.py",
    "tests/pipeline/test_trainer.py",
    "tests/scripts/test_scripts_run.py",
    "tests/training/test_context_parallel.py",
    "tests/training/test_deepseek_training.py",
    "tests/training/test_e2e.py",
    "tests/training/test_failures.py",
    "tests/training/test_host_syncs.py",
    "tests/training/test_layout_invariance.py",
    "tests/training/test_memory.py",
    "tests/training/test_megatron_optimizer_resume.py",
    "tests/training/test_moe_training.py",
    "tests/training/test_mtp_training.py",
    "tests/training/test_offload.py",
    "tests/training/test_plan_launch.py",
    "tests/training/test_restart.py",
    "tests/training/test_startup.py",
    "tests/training/test_tools_scale.py",
    "tests/zero/test_example.py",
}

# Single tests (all their parameters) as costly as a launch: the 8-rank runs (an 8-process pool costs
# its own start-up), rehearsals of real launches, subprocesses, multi-iteration training runs.
SLOW_TESTS = {
    "tests/cli/test_progress.py::test_generate_reports_tensors_loaded",
    "tests/cli/test_progress.py::test_rehearse_reports_ranks",
    "tests/cli/test_deepseek_tools.py::test_a_fine_tune_saved_as_torch_dist_exports_with_its_trained_expert_biases",
    "tests/cli/test_hf_qwen3_next.py::test_a_converted_qwen3_next_fine_tunes_alike_at_tp2_and_cp2_and_exports_back",
    "tests/model/test_flops.py::test_sharded_meta_models_count_the_same",
    "tests/model/test_ring_attention.py::test_ring_on_8_ranks",
    "tests/model/test_cp_hierarchical.py::test_hierarchical_equals_one_process",
    "tests/mpu/test_parallel_state.py::test_embedding_groups_8_ranks_tp2_pp2_dp2",
    "tests/mpu/test_parallel_state.py::test_layout_8_ranks_tp2_pp2_rank_by_rank",
    "tests/pipeline/test_training.py::test_tp2_pp2_dp2_matches_pp1",
    # the CUDA check's CPU dry run: a script starting two ranks and training nine times; the quick tier
    # keeps its checks' asserts and verdicts (same module) and their behaviours (tests/zero)
    "tests/scripts/test_gpu_check.py::test_dry_run_on_the_cpu_passes_what_runs_there",
    "tests/test_package.py::test_the_import_check_reads_torch_version_without_importing_torch",
    "tests/training/test_rehearse.py::test_zero1_pipeline_two_ranks_against_the_formulas_and_a_device_limit",
    "tests/training/test_rehearse.py::test_zero3_two_ranks_against_the_formulas",
    "tests/training/test_rehearse.py::test_a_mixtral_8x7b_launch_on_64_ranks_is_rehearsed_against_the_formula",
    "tests/training/test_rehearse.py::"
    "test_a_deepseek_v3_launch_on_1024_ranks_is_rehearsed_against_the_count_of_what_each_stage_holds",
    "tests/training/test_sgd_checkpoint.py::test_sgd_momentum_resume_equals_uninterrupted_tp2_dp2_zero1",
    "tests/zero/test_memory_plan.py::test_planned_peak_within_15_percent_of_measured",
    "tests/zero/test_parity.py::test_stage3_tp2_dp4_on_8_ranks",
    "tests/training/test_window_attention.py::test_a_torch_dist_checkpoint_keeps_the_sinks_across_layouts",
    "tests/training/test_window_attention.py::"
    "test_windows_with_packed_documents_and_multi_token_prediction_equal_one_process",
}


def pytest_configure(config) -> None:
    # pyproject's addopts already says -q: one more (pytest -q, scripts/test.sh --quick -q) would make it -qq,
    # which drops the count of passed and failed tests. Quieter than -q gains nothing worth losing that.
    config.option.verbose = max(config.option.verbose, -1)


def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        module, _, name = item.nodeid.partition("::")
        if module in SLOW_MODULES or f"{module}::{name.split('[', 1)[0]}" in SLOW_TESTS:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> str:
    """400 documents of 20-79 tokens (learnable progressions) as a Megatron .bin/.idx pair; its prefix."""
    return write_progressions(str(tmp_path_factory.mktemp("data") / "toy_text_document"), 400, (20, 80), seed=0)
