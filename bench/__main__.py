"""python -m bench [SUITE ...] [--threads N ...] [--json FILE] [--rounds R] [--only TEXT]

Prints a table of lamina against its peers (PyTorch CPU where installed) measured in the same
run, with ratios, GFLOP/s and the fraction of this machine's sgemm peak at each thread count
(the faster of MKL and OpenBLAS on a large square product, measured first)."""
import argparse
import importlib.util
import sys

from . import conv, distributed, fc, onnx, opencl, overrides, precision, rnn, selective, serve, transformer
from .harness import Bench, print_table, write_json

SUITES = {"fc": fc.run, "rnn": rnn.run, "conv": conv.run, "selective": selective.run, "opencl": opencl.run,
          "onnx": onnx.run, "precision": precision.run, "transformer": transformer.run}
# suites with their own processes and table (`--threads` does not apply)
OWN_TABLE = {"distributed": distributed.run, "serve": serve.run, "overrides": overrides.run}


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[2])
    parser.add_argument("suites", nargs="*", default=sorted(SUITES) + sorted(OWN_TABLE),
                        help=f"suites to run: {', '.join([*SUITES, *OWN_TABLE])}")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    parser.add_argument("--rounds", type=int, default=5, help="turns per implementation and case")
    parser.add_argument("--only", metavar="TEXT", help="run only the cases whose name contains TEXT")
    args = parser.parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES and s not in OWN_TABLE]
    if unknown:
        parser.error(f"unknown suite {unknown[0]!r}; suites: {', '.join([*SUITES, *OWN_TABLE])}")
    extra = {name: OWN_TABLE[name](args.rounds, only=args.only) for name in args.suites if name in OWN_TABLE}
    suites = [s for s in args.suites if s in SUITES]
    if not suites:
        if args.json:
            write_json(args.json, [], {}, extra)
            print(f"wrote {args.json}")
        return
    have_torch = importlib.util.find_spec("torch") is not None
    have_ort = importlib.util.find_spec("onnxruntime") is not None
    if not have_torch:
        print("PyTorch is not installed: peers omitted (pip install torch==2.13.0)", file=sys.stderr)

    bench = Bench(args.only)
    rows, peaks = [], {}
    try:
        for threads in args.threads:
            peaks[threads], peak_rows = bench.peak(threads)
            rows += peak_rows
            for suite in suites:
                peers = {"have_ort": have_ort} if suite in ("rnn", "onnx", "transformer") else {}
                rows += SUITES[suite](bench, threads, args.rounds, have_torch, **peers)
    finally:
        bench.close()
    print_table(rows, peaks)
    print("\npeak sgemm GFLOP/s: " + ", ".join(f"{t} thread(s) {p:.1f}" for t, p in peaks.items()))
    if args.json:
        write_json(args.json, rows, peaks, extra)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
