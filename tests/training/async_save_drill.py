"""``pretrain_gpt.py`` with a fault in its background checkpoint writes, for the ``--async-save`` tests.

``MEGAZERO_TEST_ASYNC_WRITE="fail:RANK:N"``: global rank RANK's N-th save fails once its files are
written (a ``PermissionError`` from ``on_save_written``, which runs on the writer thread);
``"hang:RANK:N:MARKER"``: its N-th save creates the file MARKER, then never finishes (the writer
thread sleeps), for a kill during the write. ``main(argv)`` is pretrain_gpt's; run as a script too.
"""

import os
import sys
import time

from megazero.training.loop import Callback


class WriteFault(Callback):
    def __init__(self, spec: str) -> None:
        kind, rank, n, *rest = spec.split(":", 3)
        self.kind, self.rank, self.n, self.marker, self.saves = kind, int(rank), int(n), (rest or [None])[0], 0

    def on_save_written(self, partial: str) -> None:
        import torch.distributed as dist

        if (dist.get_rank() if dist.is_initialized() else 0) != self.rank:
            return
        self.saves += 1
        if self.saves != self.n:
            return
        if self.kind == "fail":
            raise PermissionError(f"cannot write {os.path.basename(partial)}: permission denied (injected)")
        open(self.marker, "w").close()
        time.sleep(3600)  # a write that never finishes: the test kills the process


def main(argv) -> int:
    from megazero.cli.pretrain_gpt import main as pretrain_main

    spec = os.environ.get("MEGAZERO_TEST_ASYNC_WRITE")
    return pretrain_main(list(argv), callbacks=[WriteFault(spec)] if spec else [])


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    sys.exit(main(sys.argv[1:]))
