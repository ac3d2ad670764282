"""Suite `distributed`: data-parallel fine-tuning of the shipped language model on this machine,
one process x 2 threads against 2 MPI ranks x 1 thread (mpiexec from the mpich wheel), with the
same global batches (32 chunks of 48 tokens). For the ranks: the exposed communication (what the
last rank to reach a step's end waits for, with the exchanges overlapping backward and with
every exchange held to the step's end), the share of it the overlap hides, and the bytes each
rank sends per step against a dense allreduce of every gradient. Two samplings: 128 negatives
per token (the shipped training: the output layer's gradient touches nearly every row) and per
batch (`--shared-negatives`). The configurations take turns, `rounds` times; medians."""
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = [("1 x 2 threads", 1, 2, []), ("2 ranks x 1", 2, 1, []), ("2 ranks, no overlap", 2, 1, ["--no-overlap"])]


def _environment(threads):
    env = dict(os.environ, LAMINA_THREADS=str(threads), HYDRA_LAUNCHER="fork", PYTHONPATH=str(ROOT))
    env.pop("PMI_RANK", None)
    return env


def _run_once(ranks, threads, extra, out):
    command = [sys.executable, "-m", "bench.distributed_step", str(out), *extra]
    if ranks > 1:
        mpiexec = shutil.which("mpiexec", path=str(Path(sys.executable).parent)) or shutil.which("mpiexec")
        if mpiexec is None:
            raise RuntimeError("no mpiexec: pip install 'lamina[mpi]'")
        command = [mpiexec, "-n", str(ranks), *command]
    subprocess.run(command, env=_environment(threads), check=True, cwd=ROOT, timeout=600)
    return json.loads(Path(out).read_text())


def run(rounds=3, only=None):
    """Returns a list of result dicts (one per sampling) and prints the table. `only`: run the
    samplings ("per token", "shared") whose name contains it."""
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for sampling, flag in (("per token", []), ("shared", ["--shared-negatives"])):
            if only is not None and only not in sampling:
                continue
            runs = {name: [] for name, *_ in CONFIGS}
            for _ in range(rounds):
                for name, ranks, threads, extra in CONFIGS:
                    runs[name].append(_run_once(ranks, threads, flag + extra, Path(tmp) / "out.json"))
            med = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0] if isinstance(rs[0][k], (int, float))}
                   for name, rs in runs.items()}
            one, two, held = med["1 x 2 threads"], med["2 ranks x 1"], med["2 ranks, no overlap"]
            results.append({
                "negatives": sampling, "rounds": rounds,
                "step_ms_1x2": one["step_ms"], "step_ms_2x1": two["step_ms"],
                "ratio_2x1_to_1x2": two["step_ms"] / one["step_ms"],
                "step_ratios": [b["step_ms"] / a["step_ms"] for a, b in zip(runs["1 x 2 threads"], runs["2 ranks x 1"])],
                "exposed_ms": two["exposed_ms"], "exposed_ms_no_overlap": held["exposed_ms"],
                "hidden": 1 - two["exposed_ms"] / held["exposed_ms"],
                "wait_ms_rank0": two["wait_ms"], "loss_wait_ms_rank0": two["loss_wait_ms"],
                "step_ms_no_overlap": held["step_ms"],
                "bytes_sent": two["bytes_sent"], "dense_bytes": two["dense_bytes"],
                "sparse_bytes": two["sparse_bytes"], "sparse_dense_bytes": two["sparse_dense_bytes"]})
    print_table(results)
    print_prediction(results)
    return results


SERVERS = (2, 4, 8, 16)
LINKS = {"10 Gbit/s": (10e9 / 8, 30e-6), "100 Gbit/s": (100e9 / 8, 5e-6)}  # bytes/s, seconds per message
EXCHANGES = 3  # collectives per step: the output layer's rows, the LSTM's bucket, the embedding's rows
SHM_BANDWIDTH = 3e9  # bytes/s of a 1-4 MB MPI_Allreduce between 2 ranks on this machine (mpich, shared memory)
WINDOW = 0.5  # share of a step from the first exchange's start to backward's end (traced: ~38 of 75 ms)


def predict(r, servers, link):
    """Step time on `servers` machines like this one, each running one process of 2 threads on
    a shard of 32 chunks (so the compute per server stays the 1 x 2 step, T), over `link`:

        C = P + bytes / bandwidth + 2 (servers - 1) x latency x EXCHANGES
        step = T + max((1 - hidden) C, C - WINDOW x T)

    P, the work around the transfers (packing buckets, merging rows), is what the 2 ranks here
    waited for with overlap off less their bytes at SHM_BANDWIDTH, kept as it is for more servers.
    bytes per server: the dense parameters' ring allreduce, 2 (n-1)/n x D; each sparse table's
    allgather, (n-1) x its rows block b (the per-rank block measured here at 16 chunks, doubled
    for 32: an upper bound, since rows repeat), or the dense sum of the table and its row marks,
    2 (n-1)/n x S, once the gathered rows outnumber it (as the reducer switches); hidden is the
    share measured here; the overlap cannot hide more than the window of backward it runs in."""
    bandwidth, latency = link
    T = r["step_ms_1x2"] / 1e3
    D = r["dense_bytes"] - r["sparse_dense_bytes"]  # at 2 ranks 2 (n-1)/n = 1: the bytes themselves
    S, b = r["sparse_dense_bytes"], 2 * r["sparse_bytes"]
    n = servers
    sparse = min((n - 1) * b, 2 * (n - 1) / n * S * 1.02)
    P = max(0.0, r["exposed_ms_no_overlap"] / 1e3 - r["bytes_sent"] / SHM_BANDWIDTH)
    C = P + (2 * (n - 1) / n * D + sparse) / bandwidth + 2 * (n - 1) * latency * EXCHANGES
    return T + max((1 - r["hidden"]) * C, C - WINDOW * T), C


def print_prediction(results):
    print(f"\npredicted step ms (model: bench/distributed.py predict; compute {results[0]['step_ms_1x2']:.0f} / "
          f"{results[1]['step_ms_1x2']:.0f} ms per server at 32 chunks)")
    print(f"{'negatives':<10} {'link':<11}" + "".join(f"{n:>8} srv" for n in SERVERS))
    for r in results:
        for name, link in LINKS.items():
            cells = "".join(f"{1e3 * predict(r, n, link)[0]:12.1f}" for n in SERVERS)
            print(f"{r['negatives']:<10} {name:<11}{cells}")


def print_table(results):
    head = (f"{'negatives':<10} {'1x2 ms':>8} {'2x1 ms':>8} {'ratio':>6} {'exposed':>8} {'no overlap':>10} "
            f"{'hidden':>7} {'sent/step':>10} {'dense/step':>10} {'sparse/dense':>12}")
    print(head)
    print("-" * len(head))
    for r in results:
        print(f"{r['negatives']:<10} {r['step_ms_1x2']:8.1f} {r['step_ms_2x1']:8.1f} {r['ratio_2x1_to_1x2']:6.2f} "
              f"{r['exposed_ms']:8.2f} {r['exposed_ms_no_overlap']:10.2f} {100 * r['hidden']:6.0f}% "
              f"{r['bytes_sent'] / 1e6:8.2f}MB {r['dense_bytes'] / 1e6:8.2f}MB "
              f"{100 * r['sparse_bytes'] / r['sparse_dense_bytes']:11.1f}%")
    print("ratio: 2 ranks' step time over 1 process's (each round's ratios in the JSON); exposed: ms per step "
          "the last rank to finish backward waits for the exchanges; hidden: 1 - exposed / exposed without "
          "overlap; sparse/dense: bytes of the embedding and output-layer exchanges against a dense allreduce "
          "of those tables")
