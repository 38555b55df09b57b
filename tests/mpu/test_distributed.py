"""Start-up from a launcher's environment."""

import pytest

from megazero.mpu.distributed import first_slurm_host


@pytest.mark.parametrize("nodelist,host", [
    ("gpu[007-010,012]", "gpu007"),
    ("gpu[007-010],cpu1", "gpu007"),
    ("node12", "node12"),
    ("a1,b2", "a1"),
    ("a1,b[3-4]", "a1"),
    ("rack1-node[05,09]", "rack1-node05"),
])
def test_first_host_of_a_slurm_nodelist(nodelist, host):
    assert first_slurm_host(nodelist) == host
