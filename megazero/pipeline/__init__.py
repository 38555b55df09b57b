"""megazero.pipeline: pipeline parallelism (1F1B and interleaved 1F1B) over the PP group.

``schedules`` is the pure schedule function; ``p2p`` moves activations and gradients
between neighbouring stages; ``runner`` executes a schedule by calling a forward step
and a backward step it is handed. The package knows neither the GPT's insides nor ZeRO's.
"""

from .schedules import (Compute, Exchange, ScheduleError, Transfer, build_schedule, check_schedule_args,
                        num_warmup_microbatches, simulate)

__all__ = ["Compute", "Exchange", "Transfer", "ScheduleError", "build_schedule", "check_schedule_args",
           "num_warmup_microbatches", "simulate"]
