"""A rank that hangs or dies ends the run promptly, with the rank, its phase and host named.

Through ``torchrun pretrain_gpt.py`` on four gloo ranks: a rank stopped with SIGSTOP, a rank whose
data read never returns, a rank stuck inside a checkpoint save (whose checkpoint must never become
``latest``), a rank killed with SIGKILL. The launches run side by side (each waits on a timeout, not on
the CPU); the unit tests of the verdict sit below.
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tests.launch import BIN, ROOT

TINY = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
        "--max-position-embeddings", "8", "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data",
        "--vocab-size", "64", "--log-interval", "1", "--eval-iters", "0"]
DRILL = os.path.join(ROOT, "tests", "training", "fault_drill.py")
# 15 s timeouts: above the 10 s floor of the configuration, and the ranks of a run start alike, so no
# collective before the hang waits that long for a peer.
STOP_TIMEOUT_MIN = 0.25
SHORT_TIMEOUT_MIN = 0.25


class Launch:
    """One torchrun of four ranks, started now; its output in ``log``."""

    def __init__(self, tmp_path, name: str, args: list[str], script: str, env: dict | None = None) -> None:
        self.log_path = tmp_path / f"{name}.log"
        self.mark = f"megazero-test-{name}-{os.getpid()}-{time.time_ns()}"
        full_env = dict(os.environ, OMP_NUM_THREADS="1", MEGAZERO_TEST_MARK=self.mark,
                        PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
        self.proc = subprocess.Popen([os.path.join(BIN, "torchrun"), "--standalone", "--nproc_per_node", "4", script,
                                      *args], stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT, cwd=ROOT,
                                     env=full_env, start_new_session=True)
        self.ended_at: float | None = None
        threading.Thread(target=self._watch, daemon=True).start()

    def _watch(self) -> None:
        self.proc.wait()
        self.ended_at = time.time()  # when torchrun returned, whenever the test looks

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait_for(self, text: str, timeout_s: float = 240) -> None:
        deadline = time.time() + timeout_s
        while text not in self.log:
            assert self.proc.poll() is None, self.log[-3000:]
            assert time.time() < deadline, f"{text!r} never appeared:\n{self.log[-3000:]}"
            time.sleep(0.2)

    def worker(self, rank: int) -> int:
        """The pid of global rank ``rank``'s process (found by this launch's mark in its environment)."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            try:
                env = open(f"/proc/{entry}/environ", "rb").read().split(b"\0")
            except OSError:
                continue
            if f"MEGAZERO_TEST_MARK={self.mark}".encode() in env and f"RANK={rank}".encode() in env \
                    and b"TORCHELASTIC_RUN_ID" in b"".join(env) and entry != str(self.proc.pid):
                return int(entry)
        raise AssertionError(f"no process of rank {rank}")

    def kill(self) -> None:
        """torchrun and its workers (a killed torchrun leaves its workers running)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def wait(self, timeout_s: float = 400) -> int:
        try:
            code = self.proc.wait(timeout=timeout_s)
        finally:
            self.kill()
        while self.ended_at is None:
            time.sleep(0.01)
        return code


def _hang_env(spec: str) -> dict:
    return {"MEGAZERO_TEST_HANG": spec}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """Four runs, their waits overlapped: a rank stopped (SIGSTOP) and one killed (SIGKILL) after
    iteration 3; then, while the stopped run waits out its timeout, a data read and a save that hang."""
    tmp = tmp_path_factory.mktemp("hangs")
    script = os.path.join(ROOT, "pretrain_gpt.py")
    runs = {"stopped": Launch(tmp, "stopped", [*TINY, "--train-iters", "100000", "--distributed-timeout-minutes",
                                               str(STOP_TIMEOUT_MIN)], script),
            "killed": Launch(tmp, "killed", [*TINY, "--train-iters", "100000"], script)}
    try:
        for name, rank, sig in (("killed", 1, signal.SIGKILL), ("stopped", 2, signal.SIGSTOP)):
            runs[name].wait_for(" iteration        3/")
            os.kill(runs[name].worker(rank), sig)
            runs[name].signalled_at = time.time()
        runs["data"] = Launch(tmp, "data", [*TINY, "--train-iters", "1000", "--distributed-timeout-minutes",
                                            str(SHORT_TIMEOUT_MIN)], DRILL, _hang_env("2:data:4"))
        runs["save"] = Launch(tmp, "save", [*TINY, "--train-iters", "1000", "--distributed-timeout-minutes",
                                            str(SHORT_TIMEOUT_MIN), "--save", str(tmp / "ckpt"), "--save-interval",
                                            "2"], DRILL, _hang_env("1:save:2"))
        runs["save"].ckpt = tmp / "ckpt"
        # pp 2 x dp 2: the last stage's second rank stuck; its stage-0 partner waits on its p2p, the others
        # on their gradients
        runs["pipeline"] = Launch(tmp, "pipeline", [*TINY, "--num-layers", "2", "--pipeline-model-parallel-size",
                                                    "2", "--global-batch-size", "8", "--train-iters", "1000",
                                                    "--distributed-timeout-minutes", str(SHORT_TIMEOUT_MIN)],
                                  DRILL, _hang_env("3:data:5"))
        yield runs
    finally:
        for run in runs.values():
            run.kill()


def _last_lines(text: str, n: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


@pytest.mark.slow  # whole launches
def test_a_stopped_rank_ends_the_run_within_the_timeout_naming_it(launches):
    run = launches["stopped"]
    code = run.wait()
    took = run.ended_at - run.signalled_at
    out = run.log
    assert code != 0, out[-3000:]
    assert took <= STOP_TIMEOUT_MIN * 60 + 50, f"took {took:.0f} s\n{out[-3000:]}"
    tail = _last_lines(out)
    # the verdict (also torchrun's root cause, from the error file) names rank 2, the iteration and the host
    assert "rank 2 (host " in tail and "did not arrive" in tail, tail
    assert "no heartbeat for" in out and "a stopped or frozen process" in out, out[-3000:]
    # a stopped rank's last heartbeat may predate the loop (they go out every 2 s); its peers say where it is
    assert "waited in iteration" in tail and "(no heartbeat for" in tail and "last heard of in" in tail, tail
    assert "internal error" not in out, out[-3000:]  # a peer's closed connection is the same hang, not a second error
    assert "exitcode  : -9" in out or "Signals.SIGKILL" in out or "exitcode  : -15" in out, tail  # rank 2 killed


def _ended_naming(run, rank: int, where: str) -> str:
    """The run's output, once it has ended non-zero with the verdict naming ``rank`` in ``where``."""
    code = run.wait()
    out = run.log
    assert code != 0, out[-3000:]
    tail = _last_lines(out, 12)
    assert f"rank {rank} (host" in tail and "did not arrive" in tail and where in tail, tail
    return out


@pytest.mark.slow  # whole launches
@pytest.mark.parametrize("name,rank,iteration,waiting", [
    ("data", 2, 4, "ranks [0, 1, 3] waited in iteration 4"),
    ("pipeline", 3, 5, "rank 1 waited in iteration 5, forward-backward"),  # its stage-0 partner, on its p2p
])
def test_a_rank_stuck_in_its_data_read_is_named_with_its_stack(launches, name, rank, iteration, waiting):
    out = _ended_naming(launches[name], rank, f"iteration {iteration}, data")
    # its main thread's stack shows where it is stuck; the others waited for it
    assert f"rank {rank}'s main thread" in out and "in take" in out and "time.sleep(HOUR)" in out, out[-4000:]
    assert waiting in out, out[-3000:]
    # the stuck rank exits itself: no 30 s wait for torchrun's SIGKILL
    assert "exitcode  : -9" not in out


@pytest.mark.slow  # whole launches
def test_a_rank_stuck_in_a_checkpoint_save_leaves_latest_at_the_previous_one(launches):
    run = launches["save"]
    _ended_naming(run, 1, "iteration 4, checkpoint save")
    ckpt = run.ckpt
    assert (ckpt / "latest").read_text().strip() == "iter_0000002"
    assert not (ckpt / "iter_0000004").exists()  # only its .partial, which a resume ignores


@pytest.mark.slow  # whole launches
def test_a_killed_rank_ends_the_run_at_once(launches):
    run = launches["killed"]
    code = run.wait()
    out = run.log
    assert code != 0 and run.ended_at - run.signalled_at < 30, out[-3000:]
    assert "exitcode  : -9" in out and "rank      : 1" in out, _last_lines(out)


# -- the parts


def _beat(iteration, phase, t, forwards=0, backwards=0, passes=0, idle=0.0, host="h"):
    return {"host": host, "pid": 7, "time": t, "idle": idle, "iteration": iteration, "phase": phase,
            "forwards": forwards, "backwards": backwards, "passes": passes}


def test_the_verdict_names_silent_ranks_first():
    from megazero.training.health.watchdog import diagnose

    now = 1000.0
    beats = {0: _beat(5, "optimizer step", now - 2), 1: _beat(5, "optimizer step", now - 1),
             2: _beat(5, "forward-backward", now - 61, forwards=1, passes=4), 3: _beat(5, "data", now - 3)}
    v = diagnose(beats, now, stale_s=30, timeout_s=60)
    assert v.missing == [2]
    assert "rank 2 (host h, pid 7) did not arrive: no heartbeat for 61 s" in v.lines[0] and "last heard of in" in v.lines[0]
    assert "iteration 5, forward-backward (1 of 4 forwards, 0 of 4 backwards done)" in v.lines[0]
    assert v.line.startswith("hang: no progress for 60 s (--distributed-timeout-minutes 1): rank 2 (host h) did "
                             "not arrive (no heartbeat for 61 s: stopped or frozen); last heard of in iteration 5, "
                             "forward-backward")
    assert "; ranks [0, 1] waited in iteration 5, optimizer step" in v.line


def test_without_silent_ranks_the_furthest_behind_did_not_arrive():
    from megazero.training.health.watchdog import diagnose

    now = 50.0
    beats = {r: _beat(9, "optimizer step", now) for r in range(8)}
    beats[5] = _beat(9, "data", now, idle=40)
    beats[6] = _beat(9, "data", now, idle=40)
    beats[1] = _beat(9, "forward-backward", now, forwards=2, passes=4)
    v = diagnose(beats, now, stale_s=30, timeout_s=60)
    assert v.missing == [5, 6] and "ranks [5, 6] did not arrive" in v.line
    assert "no progress for 40 s" in v.lines[0]
    assert any(line.startswith("ranks [0, 2-4, 7] waited in iteration 9, optimizer step") for line in v.lines)


def test_when_no_rank_is_behind_the_verdict_says_so():
    from megazero.training.health.watchdog import diagnose

    beats = {r: _beat(3, "forward-backward", 10.0, forwards=2, passes=2) for r in range(4)}
    v = diagnose(beats, 10.0, stale_s=30, timeout_s=600)
    assert v.missing == [] and "no rank is behind" in v.line and "--distributed-timeout-minutes 10" in v.line


def test_a_rank_that_never_beat_is_named():
    from megazero.training.health.watchdog import diagnose

    v = diagnose({0: _beat(1, "data", 5.0), 1: None}, 5.0, stale_s=30, timeout_s=60)
    assert v.missing == [1] and "never sent a heartbeat" in v.lines[0]


def test_rank_lists_fold_runs_and_stay_short():
    from megazero.training.health.watchdog import rank_list

    assert rank_list([2]) == "rank 2"
    assert rank_list([5, 2]) == "ranks [2, 5]"
    assert rank_list(list(range(512)) + list(range(513, 1024))) == "ranks [0-511, 513-1023]"
    assert rank_list(list(range(0, 200, 2))).endswith("... (100 ranks)]")


def test_the_watchdog_declares_a_hang_from_its_own_deadline_and_agrees_through_the_store():
    """Two watchdogs on one store, in one process: rank 1 stops beating; rank 0's deadline passes."""
    import torch.distributed as dist

    from megazero.training.health import PhaseBoard
    from megazero.training.health.watchdog import Watchdog

    store = dist.HashStore()
    exits = []
    board = PhaseBoard()
    board.enter("optimizer step", iteration=3)
    frozen = Watchdog(PhaseBoard(), 1.0, rank=1, world=2, store=store, beat_s=0.1, exit=exits.append)
    frozen._beat(time.monotonic())  # one heartbeat, then silence (a stopped process)
    time.sleep(0.5)
    dog = Watchdog(board, 1.0, rank=0, world=2, store=store, beat_s=0.1, poll_s=0.05, exit=exits.append)
    with dog:
        deadline = time.time() + 10
        while not exits and time.time() < deadline:
            time.sleep(0.05)
    assert exits == [1]
    verdict = json.loads(dist.PrefixStore("megazero/health/", store).get("verdict"))
    assert verdict["missing"] == [1] and "rank 1" in verdict["line"] and "iteration 3" in verdict["line"]


def test_a_collective_timeout_is_told_from_other_errors():
    from megazero.training.health.watchdog import is_collective_timeout

    assert is_collective_timeout(RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 60000ms for recv"))
    assert not is_collective_timeout(RuntimeError("Connection closed by peer"))
    assert not is_collective_timeout(ValueError("Timed out"))


def test_nccl_gets_its_watchdog_settings_unless_the_user_set_them():
    from megazero.mpu.distributed import nccl_watchdog_env

    assert nccl_watchdog_env({})["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING" not in nccl_watchdog_env({"NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in nccl_watchdog_env({"TORCH_NCCL_DUMP_ON_TIMEOUT": "0"})


@pytest.mark.parametrize("value,message", [("0", "must be a positive number of minutes"),
                                           ("-5", "must be a positive number of minutes"),
                                           ("nan", "must be a positive number of minutes"),
                                           ("0.1", "is 6 s, too short .* give at least 0.17 .10 s.")])
def test_a_timeout_that_is_not_positive_is_refused_in_one_line(value, message):
    from megazero.config import parse_args
    from megazero.config.train_config import ConfigError

    with pytest.raises(ConfigError, match=message):
        parse_args([*TINY, "--train-iters", "2", "--distributed-timeout-minutes", value], 1)


_GROUP_TIMEOUTS = """
import sys
from megazero import mpu
from megazero.mpu.parallel_state import collective_timeout, new_group
from megazero.config import parse_args

config = parse_args(sys.argv[1:], 1)
with mpu.distributed_run("gloo", config.parallel.distributed_timeout_minutes * 60):
    mpu.initialize_model_parallel(1)
    g = mpu.get_parallel_groups()
    print([collective_timeout(x).total_seconds() for x in (None, g.tp_group, g.dp_group, g.pp_group, new_group([0]))])
"""


@pytest.mark.slow  # whole launches
def test_the_timeout_reaches_every_group():
    """The default group and every group megazero makes run under --distributed-timeout-minutes."""
    import socket

    cases = (([], 600.0), (["--distributed-timeout-minutes", "3"], 180.0))
    sockets = [socket.socket() for _ in cases]  # held together: two distinct ports
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    # the two processes side by side (each a single rank)
    procs = [subprocess.Popen([sys.executable, "-c", _GROUP_TIMEOUTS, *TINY, "--train-iters", "2", *flags],
                              env=dict(os.environ, MASTER_PORT=str(port), PYTHONPATH=ROOT), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=ROOT) for (flags, _), port in zip(cases, ports)]
    try:
        for proc, (_, seconds) in zip(procs, cases):
            out, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err[-2000:]
            assert out.strip().splitlines()[-1] == str([seconds] * 5)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


class _Engine:
    def __init__(self, total: int, grads: int) -> None:
        self.state = {"total": total, "grads": grads}

    def model_state_bytes(self) -> dict:
        return self.state


class _Run:
    def __init__(self, engine) -> None:
        self.engine = engine


def test_a_timeout_below_the_checkpoint_save_is_refused_with_the_value_to_give(monkeypatch):
    from megazero.config import parse_args
    from megazero.config.train_config import ConfigError
    from megazero.utils.phase_agreement import RunAborted
    from megazero.training.health.watchdog import check_timeout_covers_save

    config = parse_args([*TINY, "--train-iters", "2", "--save", "/tmp/unused", "--distributed-timeout-minutes", "1"], 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    # 8 ranks x 30 GB at 2 GB/s a node: 120 s of writing against a 60 s timeout
    with pytest.raises((ConfigError, RunAborted), match=r"--distributed-timeout-minutes 1 is shorter than a "
                                                        r"checkpoint save.*about 2\.0 min.*give "
                                                        r"--distributed-timeout-minutes 4"):
        check_timeout_covers_save(config, _Run(_Engine(int(40e9), int(10e9))))
    check_timeout_covers_save(config, _Run(_Engine(int(4e9), int(1e9))))  # 12 s: fine


def test_a_save_over_half_the_timeout_is_warned_of(caplog):
    from megazero.config import parse_args
    from megazero.training.health.watchdog import warn_if_save_near_timeout

    config = parse_args([*TINY, "--train-iters", "2", "--distributed-timeout-minutes", "2"], 1)
    with caplog.at_level("WARNING", logger="megazero.training.health.watchdog"):
        warn_if_save_near_timeout(config, 30.0)
        assert not caplog.records
        warn_if_save_near_timeout(config, 90.0)
    assert "the checkpoint save took 1.5 min, over half of --distributed-timeout-minutes 2" in caplog.text
    assert "give --distributed-timeout-minutes 5" in caplog.text


def test_a_store_that_does_not_answer_still_ends_the_run_with_this_ranks_view(caplog):
    """Under srun rank 0 serves the store: if it is the stopped rank, the verdict cannot be agreed."""
    import torch.distributed as dist

    from megazero.training.health import PhaseBoard
    from megazero.training.health.watchdog import Watchdog

    class Frozen(dist.Store):
        def __getattribute__(self, name):
            if name in ("add", "set", "get", "check", "wait", "multi_get"):
                raise RuntimeError("Socket Timeout")
            return super().__getattribute__(name)

    board = PhaseBoard()
    board.enter("optimizer step", iteration=7)
    exits = []
    dog = Watchdog(board, 60.0, rank=3, world=4, store=Frozen(), exit=exits.append)
    with caplog.at_level("ERROR", logger="megazero.training.health.watchdog"):
        dog.declare("rank 3 made no progress for 60 s")
    assert exits == [1]
    assert "this rank is in iteration 7, optimizer step; the rendezvous store did not answer" in caplog.text


def test_a_peers_closed_connection_waits_for_the_verdict_and_other_errors_do_not():
    import threading as th

    import torch.distributed as dist

    from megazero.training.health import PhaseBoard
    from megazero.training.health.watchdog import Watchdog

    store = dist.HashStore()
    dog = Watchdog(PhaseBoard(), 60.0, rank=0, world=2, store=store, exit=lambda code: None)
    dog.peer_error_wait_s = 5.0
    closed = RuntimeError("[gloo/pair.cc:553] Connection closed by peer [127.0.0.1]:43400")
    assert not dog._is_the_hang(ValueError("a bad file"))  # at once, no verdict
    timer = th.Timer(0.5, lambda: dist.PrefixStore("megazero/health/", store).set("verdict", "{}"))
    timer.start()
    t0 = time.monotonic()
    assert dog._is_the_hang(closed) and 0.4 < time.monotonic() - t0 < 5
    assert dog._is_the_hang(RuntimeError("Timed out waiting 60000ms for recv operation"))
