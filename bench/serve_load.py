"""The load generator of bench suite `serve`, a process of its own: `clients` concurrent
clients (asyncio, aiohttp: httpx's async client tops out near 150 requests/s at 32 connections
here, aiohttp near 2000) each send requests back to back for `seconds` after a warm-up;
prints JSON with requests/s, p50 and p99 latency (ms) and errors.

    python -m bench.serve_load URL MODEL CASE --clients 8 --seconds 3
CASE: score (the language model: 10..200 tokens and the tokens that follow them, each step's
negative log-likelihood back), logits (the same tokens, every step's 4096 logits back), encode
(the same tokens, the final state back), denoise (one 24³ volume), embed (the text encoder:
8..128 tokens, the mean-pooled embedding back).
"""
import argparse
import asyncio
import json
import time

import numpy as np


# what each case asks for (the ONNX Runtime server runs a model exported with these outputs)
OUTPUTS = {"score": ["nll"], "logits": ["logits"], "encode": ["last", "cell"], "denoise": ["denoised"],
           "embed": ["pooled"]}


def bodies(case, count=64):
    """Encoded requests (binary tensors both ways), drawn once with a fixed seed."""
    from lamina.serve.client import encode_request
    rng = np.random.default_rng(0)
    out = []
    for _ in range(count):
        if case == "denoise":
            inputs = {"noisy": rng.standard_normal((1, 1, 24, 24, 24)).astype(np.float32)}
        elif case == "embed":
            inputs = {"ids": rng.integers(0, 8192, int(rng.integers(8, 129))).astype(np.int32)}
        else:
            z = np.zeros((1, 1, 256), np.float32)
            tokens = rng.integers(0, 4096, int(rng.integers(11, 202))).astype(np.int32)
            inputs = {"ids": tokens[:-1], "h0": z, "c0": z}
            if case == "score":
                inputs["next"] = tokens[1:]
        out.append(encode_request(inputs, OUTPUTS[case]))
    return out


async def drive(url, model, requests, clients, seconds, warmup):
    from lamina.extras import require
    aiohttp = require("aiohttp", "bench")
    latencies, errors = [], []
    start = time.perf_counter()
    measure_from, stop_at = start + warmup, start + warmup + seconds
    async with aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=clients),
                                     timeout=aiohttp.ClientTimeout(total=60)) as http:
        async def client(k):
            i = k
            while time.perf_counter() < stop_at:
                body, headers = requests[i % len(requests)]
                i += clients
                t = time.perf_counter()
                async with http.post(f"/v2/models/{model}/infer", data=body, headers=headers) as r:
                    await r.read()
                    status = r.status
                done = time.perf_counter()
                if status != 200:
                    errors.append(status)
                elif t >= measure_from and done <= stop_at:
                    latencies.append(done - t)
        await asyncio.gather(*(client(k) for k in range(clients)))
    return latencies, errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("url")
    parser.add_argument("model")
    parser.add_argument("case", choices=list(OUTPUTS))
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--warmup", type=float, default=0.5)
    args = parser.parse_args()
    latencies, errors = asyncio.run(drive(args.url, args.model, bodies(args.case), args.clients, args.seconds,
                                          args.warmup))
    ms = np.array(latencies) * 1e3
    print(json.dumps({"requests": len(ms), "rps": len(ms) / args.seconds,
                      "p50_ms": float(np.percentile(ms, 50)) if len(ms) else None,
                      "p99_ms": float(np.percentile(ms, 99)) if len(ms) else None, "errors": len(errors)}))


if __name__ == "__main__":
    main()
