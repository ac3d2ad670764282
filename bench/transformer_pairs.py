"""lamina against ONNX Runtime on the `transformer` suite's inference cases, the two taking turns
in one process, each pair of adjacent calls giving one ratio: on a machine whose speed drifts by
up to 2x between minutes, the ratio of neighbouring calls varies far less than either time.

    python -m bench.transformer_pairs [--cases ragged,uniform] [--pairs 20] [--threads 2]

Prints each case's median times and the quartiles of the pairs' ratios (ONNX Runtime's time over
lamina's: above 1, lamina is faster). ONNX Runtime's workers are told not to spin between calls,
so they leave the cores to lamina's turn. Requires what the `transformer` suite requires."""
import argparse
import time

import numpy as np

from . import transformer as T


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="ragged,uniform")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import lamina as lm
    import onnxruntime as ort
    lm.set_num_threads(args.threads)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
    options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    session = ort.InferenceSession(T.export_model(), options, providers=["CPUExecutionProvider"])
    for kind in args.cases.split(","):
        ids, mask = T._padded(T.LENGTHS[kind])
        calls = {"lamina": T.lamina_infer(kind), "onnxruntime": lambda: session.run(["pooled"], {"ids": ids, "mask": mask})}
        times = {name: [] for name in calls}
        for call in calls.values():  # (warm-up)
            call(), call()
        for _ in range(args.pairs):
            for name, call in calls.items():
                start = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - start)
        ratios = np.array(times["onnxruntime"]) / np.array(times["lamina"])
        q1, median, q3 = np.percentile(ratios, [25, 50, 75])
        print(f"{kind}: lamina {np.median(times['lamina']) * 1e3:.0f} ms, onnxruntime "
              f"{np.median(times['onnxruntime']) * 1e3:.0f} ms; ratio per pair {median:.2f}x "
              f"(quartiles {q1:.2f}-{q3:.2f}, {args.pairs} pairs, {args.threads} threads)")


if __name__ == "__main__":
    main()
