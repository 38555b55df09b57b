"""megazero.pipeline: pipeline parallelism (1F1B and interleaved 1F1B) over the PP group.

* ``schedules``: the pure schedule function, ``build_schedule(pp, v, m, rank)`` -> the ordered
  forward / backward / exchange steps of one rank (Megatron-core's order), and ``simulate``
  (unit-cost clock: bubble, live activations, deadlock check).
* ``p2p``: ``PipeP2P.exchange``, one ``batch_isend_irecv`` per schedule exchange, shapes known
  up front (the chunks' ``stage_activation``).
* ``runner``: ``ScheduleRunner.run`` executes a schedule with a forward step and a backward
  step it is handed, keeping the activations in flight (``max_live``).
* ``stage_model``: ``StageModel``, what a stage needs of a model chunk (the activation crossing a
  boundary, the weight shared with the other end, a micro-batch's forward arguments); the model
  implements it, the pipeline names nothing of it.
* ``engine_step``: ``PipelineStage`` drives a ``megazero.zero`` engine through its public API
  (``engine(...)``, ``engine.backward``, ``engine.step``), completes the tied word embedding's
  gradient over the embedding group, and logs losses on the last stage.

Wiring for a trainer (one rank)::

    groups = mpu.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=v)
    module, chunks = <the model's chunks of this rank, StageModel each, and the module holding them>
    engine = zero.initialize(module, ds_config, mpu=mpu, param_names=<their names at pp = 1>)
    stage = PipelineStage(engine, chunks, groups, micro_batch_size=mbs, seq_length=seq)
    losses, updated = stage.train_step([a micro-batch the chunks take, for each of the m])

``pp = 1`` runs through the same object (the trivial schedule): megazero.training has one loop.
"""

from .engine_step import MicroBatch, PipelineStage, TiedEmbeddingGradSync, backward_step, shared_copy_parameters
from .p2p import PipeP2P
from .runner import ScheduleRunner
from .schedules import (
                        Compute,
                        Exchange,
                        ScheduleError,
                        Transfer,
                        build_schedule,
                        check_schedule_args,
                        num_warmup_microbatches,
                        simulate,
)
from .stage_model import StageModel

__all__ = ["Compute", "Exchange", "Transfer", "ScheduleError", "build_schedule", "check_schedule_args",
           "num_warmup_microbatches", "simulate", "PipeP2P", "ScheduleRunner", "PipelineStage", "MicroBatch",
           "TiedEmbeddingGradSync", "backward_step", "shared_copy_parameters", "StageModel"]
