"""megatron-core trains on CPU gloo ranks as Megatron-LM's ``train_step`` does: the oracle for optimizer state.

Inside a rank of :mod:`tests.mcore`: the model wrapped in megatron-core's ``DistributedDataParallel``, its
``get_megatron_optimizer`` (the distributed Adam; a ``ChainedOptimizer`` with an expert part under expert
parallelism), ``OptimizerParamScheduler`` and ``get_forward_backward_func``, configured from the run's
Megatron-LM ``args`` as ``pretrain_gpt.py`` configures them, each iteration reading the samples megazero's
``--mock-data`` reads (sample ``i``: ``seq_length + 1`` tokens drawn by a generator seeded ``seed * 1_000_003 +
i``), consumed in order as Megatron's pretraining sampler hands them out.

The ranks run under :func:`tests.mcore_cpu.cpu_optimizer_shims`.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch

__all__ = ["mock_samples", "MegatronCoreRun"]


def mock_samples(seed: int, vocab: int, seq_length: int, start: int, count: int) -> torch.Tensor:
    """Samples ``[start, start + count)`` of megazero's ``--mock-data``: ``[count, seq_length + 1]`` token ids."""
    rows = []
    for i in range(start, start + count):
        g = torch.Generator().manual_seed(seed * 1_000_003 + i)
        rows.append(torch.randint(0, vocab, (seq_length + 1,), generator=g))
    return torch.stack(rows)


class MegatronCoreRun:
    """One rank's training: ``step(iteration)`` runs iteration ``iteration`` (1-based) and returns the global
    batch's ``lm_loss``, the ``grad_norm`` before clipping and the ``lr`` it used, as Megatron-LM logs them.
    ``args``: the run's Megatron-LM args; ``vocab``: the tokenizer's vocabulary the mock samples draw from."""

    def __init__(self, model, args, vocab: int) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

        if ps.get_pipeline_model_parallel_world_size() != 1:
            raise ValueError("the megatron-core training fixture runs pp 1 (no pipeline schedule on CPU here)")
        self.args, self.vocab = args, vocab
        self.dp_rank, self.dp_size = ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()
        ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=args.use_distributed_optimizer,
                                                   overlap_grad_reduce=False, grad_reduce_in_fp32=False)
        self.model = DistributedDataParallel(model.config, ddp_config, model)
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
            adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
            clip_grad=args.clip_grad, use_distributed_optimizer=args.use_distributed_optimizer,
            params_dtype=torch.float32), [self.model])
        gbs = args.global_batch_size
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
            lr_warmup_steps=args.lr_warmup_iters * gbs, lr_decay_steps=(args.lr_decay_iters or args.train_iters) * gbs,
            lr_decay_style=args.lr_decay_style, start_wd=args.start_weight_decay, end_wd=args.end_weight_decay,
            wd_incr_steps=args.train_iters * gbs, wd_incr_style=args.weight_decay_incr_style,
            use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
            override_opt_param_scheduler=args.override_opt_param_scheduler)
        config = model.config  # what Megatron-LM's setup_model_and_optimizer sets on it
        config.no_sync_func = self.model.no_sync
        config.grad_scale_func = self.optimizer.scale_loss
        config.finalize_model_grads_func = finalize_model_grads

    def _micro_batches(self, iteration: int) -> list[torch.Tensor]:
        """This rank's micro-batches of ``iteration``: Megatron's sampler gives each step of
        micro_batch_size x dp samples out in rank order."""
        a = self.args
        per_step = a.micro_batch_size * self.dp_size
        start = (iteration - 1) * a.global_batch_size
        return [mock_samples(a.seed, self.vocab, a.seq_length, start + m * per_step + self.dp_rank * a.micro_batch_size,
                             a.micro_batch_size) for m in range(a.global_batch_size // per_step)]

    def _forward_step(self, data: Iterator[torch.Tensor], model) -> tuple[torch.Tensor, Any]:
        text = next(data)
        tokens, labels = text[:, :-1], text[:, 1:]
        b, s = tokens.shape
        positions = torch.arange(s).unsqueeze(0).expand(b, s)
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), diagonal=1)  # True: not attended
        losses = model(tokens, positions, mask, labels=labels)

        def loss_func(output: torch.Tensor):  # pretrain_gpt.py's: the sum over the tokens, and their count
            total = output.float().sum()
            count = torch.tensor(output.numel(), dtype=torch.int)
            return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

        return losses, loss_func

    def step(self, iteration: int) -> dict[str, float]:
        import torch.distributed as dist
        from megatron.core import parallel_state as ps
        from megatron.core.pipeline_parallel import get_forward_backward_func

        micro = self._micro_batches(iteration)
        lr = self.optimizer.param_groups[0]["lr"]
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        reduced = get_forward_backward_func()(
            forward_step_func=self._forward_step, data_iterator=iter(micro), model=[self.model],
            num_microbatches=len(micro), seq_length=self.args.seq_length,
            micro_batch_size=self.args.micro_batch_size, forward_only=False)
        ok, grad_norm, _ = self.optimizer.step()
        if not ok:
            raise RuntimeError(f"megatron-core skipped iteration {iteration}'s update")
        self.scheduler.step(increment=self.args.global_batch_size)
        total = torch.stack([r["lm loss"] for r in reduced]).sum(0)
        dist.all_reduce(total, group=ps.get_data_parallel_group())
        return {"lm_loss": float(total[0] / total[1]), "grad_norm": float(grad_norm), "lr": float(lr)}
