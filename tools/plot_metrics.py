#!/usr/bin/env python
"""Plot a training run's metrics JSONL (loss, learning rate, tokens/s).

    python tools/plot_metrics.py checkpoints/run/metrics.jsonl --output curves.png

The program is megazero.cli.plot_metrics (installed: ``megazero-plot-metrics``);
``--help`` lists its flags.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from megazero.cli.plot_metrics import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
