"""``pretrain_gpt.py`` with one rank made to hang, for the watchdog's tests (run under torchrun).

``MEGAZERO_TEST_HANG="RANK:WHERE:N"``: global rank RANK hangs (sleeps for an hour, its threads alive)
in its data loader's N-th read (WHERE ``data``), or while it writes the N-th checkpoint, after its
files are written and before the commit (WHERE ``save``, through the loop's ``on_save_written``).
"""

import os
import sys
import time

HOUR = 3600


def _hang_in_data_read(n: int) -> None:
    from megazero.training.loop import failure_protocol

    real, calls = failure_protocol.take, {"n": 0}

    def take(it, count):
        calls["n"] += 1
        if calls["n"] >= n:
            time.sleep(HOUR)  # a read that never returns: an NFS mount gone, a stuck object store
        return real(it, count)

    failure_protocol.take = take


def _hang_in_save(n: int):
    from megazero.training.loop import Callback

    class HangInSave(Callback):
        saves = 0

        def on_save_written(self, partial: str) -> None:
            self.saves += 1
            if self.saves >= n:
                time.sleep(HOUR)  # a write that never finishes

    return HangInSave()


    def on_save_written(self, partial: str) -> None:
        self.saves += 1
        if self.saves >= self.n:
            time.sleep(HOUR)


def main() -> int:
    rank, where, n = os.environ["MEGAZERO_TEST_HANG"].split(":")
    callbacks = []
    if os.environ.get("RANK") == rank:
        if where == "data":
            _hang_in_data_read(int(n))
        elif where == "save":
            callbacks.append(_hang_in_save(int(n)))
        else:
            raise SystemExit(f"MEGAZERO_TEST_HANG: WHERE must be data or save, got {where!r}")
    from megazero.cli.pretrain_gpt import main as pretrain_main

    return pretrain_main(sys.argv[1:], callbacks=callbacks)


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main())
