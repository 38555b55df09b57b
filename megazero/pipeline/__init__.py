"""megazero.pipeline: pipeline parallelism (1F1B and interleaved 1F1B) over the PP group.

* ``schedules``: the pure schedule function, ``build_schedule(pp, v, m, rank)`` -> the ordered
  forward / backward / exchange steps of one rank (Megatron-core's order), and ``simulate``
  (unit-cost clock: bubble, live activations, deadlock check).
* ``p2p``: ``PipeP2P.exchange``, one ``batch_isend_irecv`` per schedule exchange, shapes known
  up front (``[s(/tp under SP), micro_batch, h]``).
* ``runner``: ``ScheduleRunner.run`` executes a schedule with a forward step and a backward
  step it is handed, keeping the activations in flight (``max_live``).
* ``engine_step``: ``PipelineStage`` drives a ``megazero.zero`` engine through its public API
  (``engine(...)``, ``engine.backward``, ``engine.step``), completes the tied word embedding's
  gradient over the embedding group, and logs losses on the last stage.

Wiring for a trainer (one rank)::

    groups = mpu.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=v)
    module, chunks = model.pipeline_split.build_pipeline_model(gpt_config, groups, device="meta")
    engine = zero.initialize(module, ds_config, mpu=mpu, param_names=global_name_fn(chunks))
    stage = PipelineStage(engine, chunks, groups, micro_batch_size=mbs, seq_length=seq)
    losses, updated = stage.train_step([GPTBatch or (ids, labels) for each of the m micro-batches])

``pp = 1`` runs through the same object (the trivial schedule): megazero.training has one loop.
"""

from .engine_step import MicroBatch, PipelineStage, TiedEmbeddingGradSync, backward_step, shared_copy_parameters
from .p2p import PipeP2P
from .runner import ScheduleRunner
from .schedules import (Compute, Exchange, ScheduleError, Transfer, build_schedule, check_schedule_args,
                        num_warmup_microbatches, simulate)

__all__ = ["Compute", "Exchange", "Transfer", "ScheduleError", "build_schedule", "check_schedule_args",
           "num_warmup_microbatches", "simulate", "PipeP2P", "ScheduleRunner", "PipelineStage", "MicroBatch",
           "TiedEmbeddingGradSync", "backward_step", "shared_copy_parameters"]
