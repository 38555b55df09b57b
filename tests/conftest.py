"""What the whole suite shares: the ``slow`` tier and the small training corpus.

``bash scripts/test.sh`` runs every test; ``bash scripts/test.sh --quick`` (``pytest -m "not slow"``)
leaves out the modules below, which launch whole programs (``pretrain_gpt.py`` at several layouts,
the real launchers, the DeepSpeed comparison, the 13B dry runs): the tier for working on one piece.
"""

from __future__ import annotations

import pytest

from tests.helpers import write_progressions

SLOW_MODULES = {
    "tests/pipeline/test_planner.py",
    "tests/pipeline/test_trainer.py",
    "tests/scripts/test_scripts_run.py",
    "tests/training/test_e2e.py",
    "tests/training/test_failures.py",
    "tests/training/test_host_syncs.py",
    "tests/training/test_layout_invariance.py",
    "tests/training/test_memory.py",
    "tests/training/test_offload.py",
    "tests/training/test_restart.py",
    "tests/training/test_startup.py",
    "tests/training/test_tools_scale.py",
    "tests/zero/test_example.py",
}

def pytest_collection_modifyitems(config, items) -> None:
    for item in items:
        if item.nodeid.split("::", 1)[0] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def dataset(tmp_path_factory) -> str:
    """400 documents of 20-79 tokens (learnable progressions) as a Megatron .bin/.idx pair; its prefix."""
    return write_progressions(str(tmp_path_factory.mktemp("data") / "toy_text_document"), 400, (20, 80), seed=0)
