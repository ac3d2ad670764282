"""lamina against ONNX Runtime taking turns in one process, each pair of adjacent calls giving one
ratio: on a machine whose speed drifts by up to 2x between minutes, the ratio of neighbouring
calls varies far less than either time. ONNX Runtime's workers sleep between its calls (no
spinning), so they leave the cores to lamina's turn.

    python -m bench.pairs transformer [--cases ragged,uniform] [--pairs 20] [--threads 2]
    python -m bench.pairs onnx [--cases resnet18_b1,mobilenet_v2_b1] [--pairs 20] [--threads 1]
    python -m bench.pairs onnx --cases lstm_lm_int8,gru_classifier_int8 --threads 2

Prints each case's median times and the quartiles of the pairs' ratios (ONNX Runtime's time over
lamina's: above 1, lamina is faster). Requires what the suite named requires; the models are the
suite's own (exported on first use); an onnx case ending in "_int8" is the file ONNX Runtime's
`quantize_dynamic` wrote, run quantized by both."""
import argparse
import time

import numpy as np


def _calls(suite, case, threads):
    """{"lamina": callable, "onnxruntime": callable} for one case of a suite."""
    if suite == "transformer":
        from . import transformer
        transformer.export_model()
        return {"lamina": transformer.lamina_infer(case),
                "onnxruntime": transformer.ort_infer(case, threads, spin=False)}
    from . import onnx
    onnx.export_models()
    name, suffix = (case[:-len("_int8")], "_int8") if case.endswith("_int8") else (case, "")
    return {"lamina": onnx.lamina_onnx(name, suffix),
            "onnxruntime": onnx.ort_onnx(name, threads, suffix, spin=False)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("suite", choices=["transformer", "onnx"])
    parser.add_argument("--cases")
    parser.add_argument("--pairs", type=int, default=20)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args()
    cases = args.cases or ("ragged,uniform" if args.suite == "transformer" else "resnet18_b1,mobilenet_v2_b1")
    threads = args.threads or (2 if args.suite == "transformer" else 1)
    import lamina as lm
    lm.set_num_threads(threads)
    for case in cases.split(","):
        calls = _calls(args.suite, case, threads)
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
        print(f"{args.suite} {case}: lamina {np.median(times['lamina']) * 1e3:.1f} ms, onnxruntime "
              f"{np.median(times['onnxruntime']) * 1e3:.1f} ms; ratio per pair {median:.2f}x (quartiles "
              f"{q1:.2f}-{q3:.2f}, {args.pairs} pairs, {threads} thread{'s' if threads > 1 else ''})")


if __name__ == "__main__":
    main()
