"""One configuration of bench suite `distributed`, run alone or under mpiexec: the shipped
language model's fine-tuning step (Adam 1e-3) on global batches of 32 chunks of 48 tokens of
the standard library's source with 128 log-uniform negatives per token (or per batch and rank:
--shared-negatives), timed step by step after a warm-up. Rank 0 writes the medians as JSON.

    python -m bench.distributed_step OUT.json [--steps 20] [--shared-negatives]
    mpiexec -n 2 python -m bench.distributed_step OUT.json ...
"""
import argparse
import json
import statistics
import time
from pathlib import Path

import numpy as np

BATCH, CHUNK, NEGATIVES, FILES = 32, 48, 128, 40
MODELS = Path(__file__).resolve().parent.parent / "models"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--shared-negatives", action="store_true")
    parser.add_argument("--bucket-mb", type=float, default=4.0)
    parser.add_argument("--no-overlap", action="store_true", help="start every exchange at the step's end")
    args = parser.parse_args()
    import lamina as lm
    from lamina import distributed as dist
    from lamina.zoo import language

    world = dist.init() if dist.launched() else None
    net = lm.load(MODELS / "python_lm" / "model.lamina")
    tok = language.tokenizer(net)
    files = language.stdlib_split()[0][:FILES]
    chunks = [c for t in language.read_texts(files) for c in language.chunk(tok.encode(t), CHUNK)]
    opt = lm.optim.Adam(net, lr=1e-3)
    if world is not None:
        dist.data_parallel(net, opt, world, bucket_mb=args.bucket_mb, overlap=not args.no_overlap)
    batches = []
    for step in range(args.warmup + args.steps):
        index = np.random.default_rng([1, step]).permutation(len(chunks))[:BATCH]
        if world is not None:
            index = dist.shard(index, world)
        rng = np.random.default_rng([2, step, world.rank if world else 0])
        batches.append(language.training_feeds(net, [chunks[i] for i in index], NEGATIVES, rng,
                                               args.shared_negatives))
    seconds = []
    for step, feeds in enumerate(batches):
        if world is not None:
            world.barrier()  # every rank starts the step together: its time is the job's
        if step == args.warmup and world is not None:
            opt.reducer.stats.reset()
        start = time.perf_counter()
        net.train_step(feeds, opt)
        if step >= args.warmup:
            seconds.append(time.perf_counter() - start)
    result = {"ranks": world.size if world else 1, "threads": lm.get_num_threads(),
              "step_ms": 1e3 * statistics.median(seconds), "steps": args.steps,
              "shared_negatives": args.shared_negatives}
    if world is not None:
        s = opt.reducer.stats
        per_step = 1.0 / s.steps
        result.update(wait_ms=1e3 * s.wait_seconds * per_step, loss_wait_ms=1e3 * s.loss_wait_seconds * per_step,
                      in_flight_ms=1e3 * s.in_flight_seconds * per_step, hidden=s.hidden_fraction(),
                      bytes_sent=s.bytes_sent * per_step, dense_bytes=s.dense_bytes * per_step,
                      sparse_bytes=s.sparse_bytes * per_step, sparse_dense_bytes=s.sparse_dense_bytes * per_step)
        # a rank that reaches a step's end first also waits for the others to arrive; the last
        # to arrive waits only for what is left of the transfers: the step's exposed
        # communication is the least wait over the ranks
        waits = world.comm.gather(s.step_waits, root=0)
        if world.rank:
            return
        result["exposed_ms"] = 1e3 * float(np.mean(np.min(waits, axis=0)))
    with open(args.out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
