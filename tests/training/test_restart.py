"""Fault tolerance: under torchrun --max-restarts, killing a rank mid-run restarts the
group, which resumes from the latest checkpoint and finishes."""

import os
import signal
import subprocess
import sys
import time

from tests.launch import ROOT
from tests.training.test_e2e import argv


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry))
    return out


def test_killed_rank_restarts_and_resumes(dataset, tmp_path):
    save = tmp_path / "ckpt"
    args = argv(dataset, "--save", str(save), "--load", str(save), "--save-interval", "5", iters=60, tp=1, stage=2)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    log = open(tmp_path / "log.txt", "w")
    proc = subprocess.Popen([torchrun, "--standalone", "--nproc_per_node", "2", "--max-restarts", "1",
                             os.path.join(ROOT, "pretrain_gpt.py"), *args],
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        deadline = time.time() + 240
        while time.time() < deadline:  # wait for the first checkpoint, then kill one worker
            if (save / "latest").exists() and int(open(save / "latest").read().strip()[5:]) >= 10:
                break
            assert proc.poll() is None, open(tmp_path / "log.txt").read()
            time.sleep(0.2)
        workers = [p for p in _children(proc.pid) if "pretrain_gpt.py" in open(f"/proc/{p}/cmdline").read()]
        assert len(workers) == 2, workers
        os.kill(workers[1], signal.SIGKILL)
        assert proc.wait(timeout=300) == 0, open(tmp_path / "log.txt").read()
    finally:
        if proc.poll() is None:
            proc.kill()
    text = open(tmp_path / "log.txt").read()
    assert "resumed from iteration" in text, text
    assert open(save / "latest").read().strip() == "iter_0000060"
