"""A benchmark worker: reads JSON commands on stdin, answers one JSON line each (bench.harness)."""
import importlib
import json
import sys
import time
import traceback


def main():
    from bench.harness import set_threads
    fn = None
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["cmd"] == "setup":
                module, name = msg["factory"].split(":")
                fn = getattr(importlib.import_module(module), name)(*msg["args"])
                set_threads(msg["threads"])
                for _ in range(msg["warmup"]):
                    fn()
                if hasattr(fn, "reset"):  # its report covers the timed calls only
                    fn.reset()
                reply = {"ok": True}
            elif msg["cmd"] == "time":  # consecutive calls for about msg["seconds"], at least one
                seconds, start = [], time.perf_counter()
                while not seconds or time.perf_counter() - start < msg["seconds"]:
                    t0 = time.perf_counter()
                    fn()
                    seconds.append(time.perf_counter() - t0)
                reply = {"seconds": seconds}
            elif msg["cmd"] == "report":  # what the callable reports of its calls, if anything
                reply = fn.report() if hasattr(fn, "report") else {}
            else:
                reply = {"error": f"unknown command {msg['cmd']!r}"}
        except Exception:
            reply = {"error": traceback.format_exc()}
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
