"""Point-to-point transfers between pipeline stages, one batch per schedule exchange.

Every message has a shape known before it arrives (Megatron's ``tensor_shape``:
``[s, micro_batch, h]``, or ``[s / tp, micro_batch, h]`` under sequence
parallelism, where each TP rank sends only its own sequence shard to the same TP
rank of the next stage: the shards never get gathered for the trip). Receivers
therefore allocate without a size handshake.

A batch is posted at once with ``torch.distributed.batch_isend_irecv`` and waited
as a whole, so a rank can send downstream and receive from upstream in one step
without either side blocking the other. The schedule orders the messages of one
channel identically at both ends (activations first), which both NCCL (order of
posting) and gloo (order per source and tag) rely on to pair them.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.distributed as dist

__all__ = ["PipeP2P"]


class PipeP2P:
    """Moves tensors between pipeline ranks of one pipeline.

    ``pp_ranks[i]`` is the global rank of pipeline rank ``i``; ``group`` the PP group.
    ``bytes_sent``/``bytes_received``/``messages`` count traffic for planners and tests.
    """

    def __init__(self, group: Optional[dist.ProcessGroup], pp_ranks: Sequence[int], *, device: torch.device | str = "cpu") -> None:
        self.group = group
        self.pp_ranks = tuple(pp_ranks)
        self.device = torch.device(device)
        self.bytes_sent = 0
        self.bytes_received = 0
        self.messages = 0

    def exchange(self, sends: Sequence[tuple[int, torch.Tensor]],
                 recvs: Sequence[tuple[int, tuple[int, ...], torch.dtype]]) -> list[torch.Tensor]:
        """Post ``sends`` ``(peer pp rank, tensor)`` and ``recvs`` ``(peer pp rank, shape, dtype)`` as one
        batch, wait for all of them, and return the received tensors in ``recvs`` order."""
        ops, out = [], []
        for peer, t in sends:
            t = t.detach()
            if not t.is_contiguous():
                t = t.contiguous()
            ops.append(dist.P2POp(dist.isend, t, self._global(peer), group=self.group))
            self.bytes_sent += t.numel() * t.element_size()
        for peer, shape, dtype in recvs:
            buf = torch.empty(shape, dtype=dtype, device=self.device)
            ops.append(dist.P2POp(dist.irecv, buf, self._global(peer), group=self.group))
            out.append(buf)
            self.bytes_received += buf.numel() * buf.element_size()
        if ops:
            self.messages += len(ops)
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        return out

    def _global(self, pp_rank: int) -> int:
        if not 0 <= pp_rank < len(self.pp_ranks):
            raise ValueError(f"pipeline rank {pp_rank} is outside this pipeline of {len(self.pp_ranks)} stages")
        return self.pp_ranks[pp_rank]
