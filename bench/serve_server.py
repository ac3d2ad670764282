"""A server for bench suite `serve`: lamina with dynamic batching, lamina with batching off, or
ONNX Runtime running the exported model per request behind the same server code (the same
Starlette app, protocol and queue, the model call replaced).

    python -m bench.serve_server KIND MODEL_FILE ONNX_FILE [--threads 2]
KIND: lamina | nobatch | ort. Prints the URL when it listens.
"""
import argparse

import numpy as np


def ort_model(name, net, onnx_path, threads):
    """A ServedModel that runs each request alone in ONNX Runtime."""
    import onnxruntime as ort
    from lamina.serve.batching import ServedModel
    from lamina.serve.protocol import encode_response

    class OrtServedModel(ServedModel):
        def __init__(self):
            super().__init__(name, net, max_batch_size=1)
            options = ort.SessionOptions()
            options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
            self.session = ort.InferenceSession(onnx_path, options, providers=["CPUExecutionProvider"])
            self.names = [i.name for i in self.session.get_inputs()]

        def _run_together(self, batch):
            results = []
            for p in batch:
                feeds = {}
                for k, a in p.arrays.items():
                    if self.net.values[k].spec.sequence:  # the request's sequences, padded, and their lengths
                        seqs = a if isinstance(a, list) else [a]
                        padded = np.zeros((len(seqs), max(map(len, seqs))) + seqs[0].shape[1:], seqs[0].dtype)
                        for i, one in enumerate(seqs):
                            padded[i, :len(one)] = one
                        feeds[k] = padded.astype(np.int64) if padded.dtype.kind in "iu" else padded
                        feeds["lengths"] = np.array([len(one) for one in seqs], np.int64)
                    else:
                        feeds[k] = a
                outs = self.session.run(list(p.outputs), {k: v for k, v in feeds.items() if k in self.names})
                mine = {o: (v[0] if self.net.values[self.net.output_values[o]].spec.sequence else v)
                        for o, v in zip(p.outputs, outs)}
                results.append(encode_response(self.name, p.request_id, mine, p.binary))
            return results
    return OrtServedModel()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("kind", choices=["lamina", "nobatch", "ort"])
    parser.add_argument("model")
    parser.add_argument("onnx")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import lamina as lm
    from lamina.serve import load_models, model_name, serve
    lm.set_num_threads(args.threads)
    name = model_name(args.model)
    if args.kind == "ort":
        models = {name: ort_model(name, lm.load(args.model), args.onnx, args.threads)}
    else:
        models = load_models([args.model], max_batch_size=1 if args.kind == "nobatch" else 32, max_delay=0.0)

    def ready(server):
        host, port = server.servers[0].sockets[0].getsockname()[:2]
        print(f"http://{host}:{port}", flush=True)
    serve(models, "127.0.0.1", 0, timeout=60.0, on_ready=ready)


if __name__ == "__main__":
    main()
