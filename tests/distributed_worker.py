"""Run by tests/test_distributed.py under mpiexec: trains one network data-parallel for a few
steps over global batches that every rank builds the same way, and writes this rank's parameters
to OUT/rank<r>.npz. The test repeats the same global batches in one process and compares.

    mpiexec -n N python tests/distributed_worker.py CASE OPTIMIZER STEPS OUT [--fail MODE]

--fail kill|raise|hang|late: rank 1 dies (SIGKILL), raises, stops answering, or pauses 3 s at
step 3 (rank 0 then records the CPU time it spent waiting in that step).
--record-grads: every rank saves the gradients its optimizer is handed in the first step (the
sums over the ranks), as grad/<parameter>.
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
    parser.add_argument("--fail", choices=["kill", "raise", "hang", "late"])
    parser.add_argument("--record-grads", action="store_true")
    parser.add_argument("--timeout", type=float, default=dist.DEFAULT_TIMEOUT)
    args = parser.parse_args()
    world = dist.init(timeout=args.timeout)
    case = CASES[args.case]()
    lm.manual_seed(100 + world.rank)  # every rank starts apart: data_parallel must copy rank 0's
    net = case.network()
    opt = optimizer(args.optimizer, net)
    dist.data_parallel(net, opt, world, bucket_mb=case.bucket_mb)
    grads = record_gradients(net, opt) if args.record_grads else {}
    losses, extra = [], {}
    for step in range(args.steps):
        if args.fail and world.rank == 1 and step == 3:
            if args.fail == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if args.fail == "raise":
                raise RuntimeError("rank 1 fails on purpose at step 3")
            time.sleep(3 if args.fail == "late" else 3600)
        index = dist.shard(case.global_batch(step), world)
        cpu, wall = time.process_time(), time.monotonic()
        if len(index):
            losses.append(net.train_step(case.feeds(net, index, step, world.rank), opt))
        else:
            losses.append(net.idle_step(opt))
        if args.fail == "late" and step == 3:
            extra.update(wait_cpu=time.process_time() - cpu, wait_wall=time.monotonic() - wall)
        if args.record_grads and step == 0:
            opt.update_summed = grads.pop("__original__")
    values = {name: p.value for name, p in net.named_parameters()}
    np.savez(Path(args.out) / f"rank{world.rank}.npz", losses=np.array(losses),
             dense_rows_steps=opt.reducer.stats.dense_row_sums, **values, **grads, **extra)


def record_gradients(net, opt):
    """Record, as grad/<name>, each gradient the optimizer is handed (dense; a row gradient's
    other rows zero) until the caller puts update_summed back."""
    names = {id(p): name for name, p in net.named_parameters()}
    grads = {"__original__": opt.update_summed}

    def record(p):
        g = np.array(lm.parameter.host(p.grad), copy=True)
        if p.grad_rows is not None:
            dense = np.zeros_like(g)
            dense[p.grad_rows] = g[p.grad_rows]
            g = dense
        grads[f"grad/{names[id(p)]}"] = g
        grads["__original__"](p)
    opt.update_summed = record
    return grads


if __name__ == "__main__":
    main()
