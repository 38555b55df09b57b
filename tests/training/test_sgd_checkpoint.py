"""--optimizer sgd with --save/--load: the momentum buffer is saved beside the masters, so a resume equals
the uninterrupted run, also at another tp x dp x ZeRO stage; an Adam run cannot load it as its own."""

import pytest

from tests.training.test_e2e import _pretrain, argv, run
from tests.distributed import run_distributed

SGD = ("--optimizer", "sgd", "--sgd-momentum", "0.9")


def test_sgd_momentum_resume_equals_uninterrupted_tp2_dp2_zero1(dataset, tmp_path):
    full, _, _ = run(4, argv(dataset, *SGD, "--save", str(tmp_path / "a"), "--save-interval", "3", stage=1, iters=6))
    part1, _, it1 = run(4, argv(dataset, *SGD, "--save", str(tmp_path / "b"), "--save-interval", "3",
                                "--exit-interval", "3", stage=1, iters=6))
    assert it1 == 3
    part2, _, it2 = run(4, argv(dataset, *SGD, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b"),
                                stage=1, iters=6))
    assert it2 == 6 and sorted(part2) == [4, 5, 6]
    resumed = {**part1, **part2}
    for i in range(1, 7):
        assert resumed[i] == pytest.approx(full[i], abs=1e-6), (i, resumed[i], full[i])
    assert abs(full[6] - full[1]) > 1e-3  # the steps moved the weights
    # Without the momentum buffer (--no-load-optim) iteration 4 takes a plain gradient step: the loss at 5
    # differs, so the equality above needs the saved buffer.
    (tmp_path / "b" / "latest").write_text("iter_0000003\n")
    fresh, _, _ = run(4, argv(dataset, *SGD, "--load", str(tmp_path / "b"), "--no-load-optim", stage=1, iters=6))
    assert abs(fresh[5] - full[5]) > 1e-4, (fresh[5], full[5])
    # Resharded: the tp 2 x dp 2 checkpoint of iteration 3 resumed at tp 1 x dp 4 ZeRO-1 and tp 4 ZeRO-2.
    for tp, stage in ((1, 1), (4, 2)):
        losses, _, it = run(4, argv(dataset, *SGD, "--load", str(tmp_path / "b"), tp=tp, stage=stage, iters=6))
        assert it == 6 and sorted(losses) == [4, 5, 6]
        for i in (4, 5, 6):
            assert losses[i] == pytest.approx(full[i], abs=2e-5), (tp, stage, i, losses[i], full[i])


def _load_with_adam(args, world):
    from megazero.utils.phase_agreement import RunAborted

    try:
        _pretrain(args, world)
    except RunAborted as e:  # the checkpoint error, agreed on by every rank
        return str(e)
    return None


def test_adam_refuses_an_sgd_checkpoint(dataset, tmp_path):
    run(2, argv(dataset, *SGD, "--save", str(tmp_path), "--save-interval", "2", tp=2, stage=1, iters=2))
    msg = run_distributed(2, _load_with_adam, argv(dataset, "--load", str(tmp_path), tp=2, stage=1, iters=3), 2)[0]
    assert msg is not None and "holds optimizer state ['momentum_buffer']" in msg and "Adam" in msg, msg


def test_finetune_from_an_sgd_checkpoint_with_adam_reads_the_weights_only(dataset, tmp_path):
    # Megatron's --finetune / --no-load-optim: the optimizer starts afresh, so its kind may change.
    run(2, argv(dataset, *SGD, "--save", str(tmp_path), "--save-interval", "2", tp=2, stage=1, iters=2))
    for flag in ("--finetune", "--no-load-optim"):
        msg = run_distributed(2, _load_with_adam, argv(dataset, "--load", str(tmp_path), flag,
                                                        "--override-opt_param-scheduler", tp=2, stage=1, iters=3), 2)[0]
        assert msg is None, (flag, msg)
