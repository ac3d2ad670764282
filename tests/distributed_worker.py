"""Run by tests/test_distributed.py under mpiexec: trains one network data-parallel for a few
steps over global batches that every rank builds the same way, and writes this rank's parameters
to OUT/rank<r>.npz. The test repeats the same global batches in one process and compares.

    mpiexec -n N python tests/distributed_worker.py CASE OPTIMIZER STEPS OUT [--fail MODE]

--fail kill|raise|hang: rank 1 dies (SIGKILL), raises, or stops answering at step 3.
"""
import argparse
import os
import signal
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import lamina as lm  # noqa: E402
from lamina import distributed as dist  # noqa: E402
from distributed_cases import CASES, optimizer  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("case", choices=sorted(CASES))
    parser.add_argument("optimizer")
    parser.add_argument("steps", type=int)
    parser.add_argument("out")
    parser.add_argument("--fail", choices=["kill", "raise", "hang"])
    parser.add_argument("--timeout", type=float, default=dist.DEFAULT_TIMEOUT)
    args = parser.parse_args()
    world = dist.init(timeout=args.timeout)
    case = CASES[args.case]()
    lm.manual_seed(100 + world.rank)  # every rank starts apart: data_parallel must copy rank 0's
    net = case.network()
    opt = optimizer(args.optimizer, net)
    dist.data_parallel(net, opt, world, bucket_mb=case.bucket_mb)
    losses = []
    for step in range(args.steps):
        if args.fail and world.rank == 1 and step == 3:
            if args.fail == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fail == "raise":
                raise RuntimeError("rank 1 fails on purpose at step 3")
            time.sleep(3600)
        index = dist.shard(case.global_batch(step), world)
        if len(index):
            losses.append(net.train_step(case.feeds(net, index, step, world.rank), opt))
        else:
            losses.append(net.idle_step(opt))
    values = {name: p.value for name, p in net.named_parameters()}
    np.savez(Path(args.out) / f"rank{world.rank}.npz", losses=np.array(losses),
             dense_rows_steps=opt.reducer.stats.dense_row_sums, **values)


if __name__ == "__main__":
    main()
