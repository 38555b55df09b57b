"""The training loop's components each decide when they act; callbacks hear the loop; the console
shows the log as pretrain_gpt.py prints it."""

import contextlib
import io
import logging
import os

import torch

from megazero.config import parse_args
from megazero.training.loop import Callback, Callbacks, Checkpointer, StopPolicy, TrainState
from megazero.utils.output import RankZero, console
from tests.distributed import run_distributed

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
        "--max-position-embeddings", "16", "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3",
        "--mock-data", "--vocab-size", "64", "--eval-iters", "0"]


def config(*extra, iters=6):
    return parse_args(TINY + ["--train-iters", str(iters), *extra], 1, check_files=False)


def test_state_advances_by_batches():
    state = TrainState(iteration=2, consumed_samples=8, tokens=128)
    state.advance(4, 16)
    assert (state.iteration, state.consumed_samples, state.tokens, state.batch_size) == (3, 12, 192, 4)


def test_stop_policy_ends_training_at_iterations_and_tokens_and_exits_at_the_interval():
    with StopPolicy(config(iters=6), torch.device("cpu")) as stop:
        assert not stop.before_step(TrainState(iteration=5))
        assert stop.before_step(TrainState(iteration=6)) and stop.ends_training and stop.reason is None
    with StopPolicy(config("--train-tokens", "128", iters=6), torch.device("cpu")) as stop:
        assert not stop.before_step(TrainState(iteration=1, tokens=64))
        assert stop.before_step(TrainState(iteration=2, tokens=128))
        assert stop.ends_training and stop.reason == "--train-tokens 128 reached"
    with StopPolicy(config("--exit-interval", "3"), torch.device("cpu")) as stop:
        assert not stop.after_step(TrainState(iteration=2))
        assert stop.after_step(TrainState(iteration=3))
        assert not stop.ends_training and stop.reason == "--exit-interval 3"
    with StopPolicy(config("--skip-train"), torch.device("cpu")) as stop:
        assert stop.before_step(TrainState())


class _Recorded(Checkpointer):
    """The checkpointer's decisions, without writing."""

    def __init__(self, cfg):
        super().__init__(cfg, run=None, scheduler=None)
        self.saved = []

    def save(self, state, save_dir=None):
        self.saved.append(state.iteration)
        if save_dir is None:
            self.last_saved = state.iteration
        return ""


def test_checkpointer_saves_at_the_interval_and_once_at_an_exit(tmp_path):
    ck = _Recorded(config("--save", str(tmp_path), "--save-interval", "2"))
    for it in range(1, 5):
        ck.after_step(TrainState(iteration=it))
    assert ck.saved == [2, 4]
    ck.on_exit(TrainState(iteration=4))  # just saved: not again
    ck.on_exit(TrainState(iteration=5))
    assert ck.saved == [2, 4, 5]
    nothing = _Recorded(config("--save-interval", "2"))  # no --save: no regular saves
    nothing.after_step(TrainState(iteration=2))
    nothing.on_exit(TrainState(iteration=3))
    nothing.at_end(TrainState(iteration=3))
    assert nothing.saved == []


def test_callbacks_call_each_hook_in_order():
    heard = []

    class Named(Callback):
        def __init__(self, name):
            self.name = name

        def on_step_end(self, state, result):
            heard.append((self.name, state.iteration))

        def on_save(self, path):
            heard.append((self.name, path))

    hooks = Callbacks([Named("a"), Named("b")])
    hooks.on_step_end(TrainState(iteration=1), None)
    hooks.on_save("p")
    hooks.on_step_start(TrainState(), [])  # a hook nobody overrides does nothing
    assert heard == [("a", 1), ("b", 1), ("a", "p"), ("b", "p")]


def test_console_sends_info_to_stdout_and_errors_to_stderr_once_and_restores():
    log = logging.getLogger("megazero.training.test_console")
    out, err = io.StringIO(), io.StringIO()
    parent = logging.getLogger("megazero.training")
    before = (parent.level, parent.propagate, list(parent.handlers))
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        with console("megazero.training"), console("megazero.training"):  # nested: one handler
            log.info(" iteration 1 | loss 2.0 |")
            log.error("error: bad flag")
    assert out.getvalue() == " iteration 1 | loss 2.0 |\n"
    assert err.getvalue() == "error: bad flag\n"
    assert (parent.level, parent.propagate, list(parent.handlers)) == before
    assert RankZero().filter(logging.makeLogRecord({}))  # no process group: every process is rank 0


class Heard(Callback):
    def __init__(self):
        self.events = []

    def on_train_start(self, state, run):
        self.events.append(("start", state.iteration))

    def on_step_start(self, state, batches):
        self.events.append(("step", state.iteration, len(batches)))

    def on_step_end(self, state, result):
        self.events.append(("end", state.iteration, result.updated, result.batch_size))

    def on_save_written(self, directory):
        self.events.append(("written", os.path.basename(directory)))

    def on_save(self, path):
        self.events.append(("saved", os.path.basename(path)))


def _run_heard(save):
    from megazero.training.trainer import pretrain

    heard = Heard()
    out = io.StringIO()
    with contextlib.redirect_stdout(out), console("megazero.training"):
        result = pretrain(config("--save", save, "--save-interval", "2", "--log-interval", "1", iters=3),
                          callbacks=[heard])
    return heard.events, result.iteration, out.getvalue()


def test_callbacks_hear_the_loop_in_order(tmp_path):
    events, iteration, log = run_distributed(1, _run_heard, str(tmp_path))[0]
    assert iteration == 3
    assert events == [("start", 0),
                      ("step", 0, 2), ("end", 1, True, 4),
                      ("step", 1, 2), ("end", 2, True, 4), ("written", "iter_0000002.partial"),
                      ("saved", "iter_0000002"),
                      ("step", 2, 2), ("end", 3, True, 4), ("written", "iter_0000003.partial"),
                      ("saved", "iter_0000003")]
    lines = log.splitlines()
    assert [ln.split("|")[0].split()[1] for ln in lines if ln.startswith(" iteration")] == ["1/", "2/", "3/"]
    assert sum(ln.startswith("saved checkpoint") for ln in lines) == 2
