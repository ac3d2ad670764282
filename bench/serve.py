"""Suite `serve`: `lamina serve` under load from a generator in its own process (bench.serve_load,
asyncio + aiohttp, binary tensors) at 1, 8 and 32 concurrent clients. Three servers take turns on
the same requests: lamina with dynamic batching (up to 32 requests; a batch starts as soon as the model is free,
with whatever queued meanwhile), lamina with batching
off, and ONNX Runtime running the exported model per request behind the same server code
(bench.serve_server). Cases: the language model scoring 10..200 tokens (each step's negative
log-likelihood of the token that follows), the same tokens with every logit back, and encoding
them (final state back); the denoiser on 24³ volumes; the MiniLM-L6-shaped text encoder of suite
`transformer` (random weights) embedding 8..128 tokens (the mean-pooled output back). For each: requests/s, p50 and p99
latency, and the mean batch size (from the server's /metrics)."""
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

from .serve_load import OUTPUTS

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"python_lm": ROOT / "models" / "python_lm" / "model.lamina",
          "denoise3d": ROOT / "models" / "denoise3d" / "model.lamina",
          "encoder": None}  # bench.transformer's encoder, saved into the run's folder
CASES = [("python_lm", "score"), ("python_lm", "logits"), ("python_lm", "encode"), ("denoise3d", "denoise"),
         ("encoder", "embed")]
SERVERS = ["lamina", "nobatch", "ort"]
CLIENTS = (1, 8, 32)


def _start(kind, model_path, onnx_path, threads):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "bench.serve_server", kind, str(model_path), str(onnx_path),
                             "--threads", str(threads)], stdout=subprocess.PIPE, text=True, env=env,
                            stdin=subprocess.DEVNULL)
    url = proc.stdout.readline().strip()
    if not url.startswith("http://"):
        proc.kill()
        raise RuntimeError(f"bench.serve_server {kind} {model_path} did not start")
    return proc, url


def _batches(url, model):
    text = httpx.get(f"{url}/metrics").text
    found = [re.search(rf'lamina_batch_size_{k}{{model="{model}"}} (\S+)', text) for k in ("count", "sum")]
    return [float(m.group(1)) if m else 0.0 for m in found]


def run(rounds=1, seconds=3.0, threads=2, only=None):
    """`only`: run the cases whose name (score, logits, encode, denoise, embed) contains it."""
    import lamina as lm
    results = []
    cases = [(model, case) for model, case in CASES if only is None or only in case]
    with tempfile.TemporaryDirectory() as tmp:
        onnx, paths = {}, dict(MODELS)
        if any(model == "encoder" for model, _ in cases):
            from .transformer import lamina_encoder
            paths["encoder"] = Path(tmp) / "encoder" / "model.lamina"
            paths["encoder"].parent.mkdir()
            lm.save(lamina_encoder(), paths["encoder"])
        for model, case in cases:  # what a do-it-yourself service would export: the outputs it serves
            onnx[case] = Path(tmp) / f"{model}-{case}.onnx"
            lm.onnx.save(lm.load(paths[model]), onnx[case], OUTPUTS[case])
        for model, case in cases:
            for clients in CLIENTS:
                for kind in SERVERS:
                    proc, url = _start(kind, paths[model], onnx[case], threads)
                    try:
                        before = _batches(url, model)
                        out = subprocess.run([sys.executable, "-m", "bench.serve_load", url, model, case, "--clients",
                                              str(clients), "--seconds", str(seconds)], capture_output=True, text=True,
                                             env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True, timeout=300)
                        after = _batches(url, model)
                    finally:
                        proc.terminate()
                        proc.wait(30)
                    r = json.loads(out.stdout)
                    if r["errors"] or not r["requests"]:
                        raise RuntimeError(f"server {kind}, {case}, {clients} clients: {r['errors']} errors, "
                                           f"{r['requests']} answers")
                    r.update(model=model, case=case, clients=clients, server=kind,
                             mean_batch=(after[1] - before[1]) / max(after[0] - before[0], 1))
                    results.append(r)
                    print(f"{case:<8} {clients:>3} clients  {kind:<8} {r['rps']:8.1f} req/s  p50 {r['p50_ms']:7.2f} ms  "
                          f"p99 {r['p99_ms']:7.2f} ms  batch {r['mean_batch']:5.1f}  errors {r['errors']}", flush=True)
    print_table(results)
    return results


def print_table(results):
    print(f"\n{'case':<8} {'clients':>7}  " + "  ".join(f"{k + ' req/s':>14} {'p50':>7} {'p99':>7} {'batch':>5}"
                                                   for k in SERVERS) + f"  {'vs ort':>7}")
    rows = {}
    for r in results:
        rows.setdefault((r["case"], r["clients"]), {})[r["server"]] = r
    for (case, clients), by in rows.items():
        cells = "  ".join(f"{by[k]['rps']:14.1f} {by[k]['p50_ms']:7.1f} {by[k]['p99_ms']:7.1f} {by[k]['mean_batch']:5.1f}"
                          for k in SERVERS)
        print(f"{case:<8} {clients:>7}  {cells}  {by['lamina']['rps'] / by['ort']['rps']:6.2f}x")
    print("req/s: answered per second; p50/p99: latency in ms; batch: mean requests per batch run; "
          "vs ort: lamina (batching) throughput over ONNX Runtime's")
