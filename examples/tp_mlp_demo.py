"""A two-layer MLP split across tensor-parallel ranks, checked against one process.

    torchrun --nproc_per_node 4 examples/tp_mlp_demo.py --tp 2
"""

import argparse

import torch
import torch.nn.functional as F

from megazero import mpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--tp", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rank, world = mpu.init_distributed()
    groups = mpu.initialize_model_parallel(args.tp)
    torch.manual_seed(0)
    fc1 = mpu.ColumnParallelLinear(32, 128, gather_output=False)
    fc2 = mpu.RowParallelLinear(128, 32, input_is_parallel=True)
    x = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    h, _ = fc1(x)
    y, _ = fc2(F.gelu(h))

    ref1, ref2 = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)
    torch.manual_seed(0)  # the same seed gives the same full weights whatever the tp
    for ref in (ref1, ref2):
        torch.nn.init.normal_(ref.weight, std=0.02)
        torch.nn.init.zeros_(ref.bias)
    y_ref = ref2(F.gelu(ref1(x)))
    err = (y - y_ref).abs().max().item()
    if rank == 0:
        print(f"world={world} tp={groups.tp_size} dp={groups.dp_size}: "
              f"max |TP output - single-process output| = {err:.2e}")
    mpu.shutdown_distributed()


if __name__ == "__main__":
    main()
