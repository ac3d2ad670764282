"""The Triton extensions of the Open Inference Protocol that clients call besides inference:
model configuration, the repository index, inference statistics, and classification (an
output's top-k classes as "score:index" strings).

    GET  /v2/models/{name}/config      the model's configuration (inputs, outputs, batching)
    POST /v2/repository/index          every model, its version and state
    GET  /v2/models/stats              statistics of every model
    GET  /v2/models/{name}/stats       statistics of one model
"""
import threading
import time

import numpy as np

from .protocol import DATATYPES, spec_datatype

CONFIG_TYPES = {"FP32": "TYPE_FP32", "INT32": "TYPE_INT32"}


class Statistics:
    """A model's counts and nanoseconds in the protocol's statistics form: requests that
    succeeded and failed (with their whole time), time queued and computing, batches run and
    the requests in them, and the time of the last inference."""

    def __init__(self):
        self._lock = threading.Lock()
        self.kinds = {k: [0, 0] for k in ("success", "fail", "queue", "compute_input", "compute_infer",
                                          "compute_output")}
        self.inference_count = self.execution_count = self.last_inference = 0
        self.batches = {}  # batch size -> [count, compute ns]

    def add(self, kind, seconds, count=1):
        with self._lock:
            entry = self.kinds[kind]
            entry[0] += count
            entry[1] += int(seconds * 1e9)

    def batch(self, size, seconds):
        with self._lock:
            self.inference_count += size
            self.execution_count += 1
            self.last_inference = int(time.time() * 1000)
            entry = self.batches.setdefault(size, [0, 0])
            entry[0] += 1
            entry[1] += int(seconds * 1e9)

    def document(self, name):
        with self._lock:
            duration = lambda count, ns: {"count": count, "ns": ns}
            return {"name": name, "version": "1", "last_inference": self.last_inference,
                    "inference_count": self.inference_count, "execution_count": self.execution_count,
                    "inference_stats": {k: duration(*v) for k, v in self.kinds.items()},
                    "batch_stats": [{"batch_size": size, "compute_input": duration(count, 0),
                                     "compute_infer": duration(count, ns), "compute_output": duration(count, 0)}
                                    for size, (count, ns) in sorted(self.batches.items())]}


def model_config(name, model):
    """GET /v2/models/{name}/config: the model's configuration as Triton writes it (dims per
    sample, -1 where a sequence's steps vary and on an input's dynamic axes), with lamina's batching settings and limits."""
    net = model.net

    def tensor(vname, spec):
        dynamic = net.dynamic_axes.get(vname, {})
        dims = ([-1] if spec.sequence else []) + [-1 if i in dynamic else size for i, size in enumerate(spec.shape)]
        return {"name": vname, "data_type": CONFIG_TYPES[spec_datatype(spec)], "dims": dims or [1]}
    inputs = [tensor(v, net.values[v].spec) for v in model.inputs]
    for entry in inputs:
        entry["optional"] = entry["name"] in model.optional
    outputs = [tensor(o, net.values[net.output_values[o]].spec) for o in model.outputs]
    limits = model.limits
    return {"name": name, "platform": "lamina", "backend": "lamina", "version_policy": {"latest": {"num_versions": 1}},
            "max_batch_size": model.max_batch_size, "input": inputs, "output": outputs,
            "dynamic_batching": {"max_queue_delay_microseconds": int(model.max_delay * 1e6),
                                 "default_queue_policy": {"max_queue_size": model.max_queue}},
            "parameters": {key: {"string_value": str(value)} for key, value in (
                ("sequence_model", model.sequence_model), ("max_sequence_length", limits.max_sequence_length),
                ("max_rows", limits.max_rows), ("max_elements", limits.max_elements),
                ("max_batch_bytes", model.max_batch_bytes))}}


def repository_index(models, ready):
    return [{"name": name, "version": "1", "state": "READY" if ready else "UNAVAILABLE"} for name in sorted(models)]


def classify(a, k):
    """The protocol's classification of an output: for each row (the last axis holds the
    classes), its k highest scores as "score:index" strings, best first (shape [..., k])."""
    classes = a.shape[-1] if a.ndim else 1
    k = min(k, classes)
    flat = a.reshape(-1, classes)
    top = np.argsort(-flat, axis=1, kind="stable")[:, :k]
    strings = np.array([[f"{row[i]:f}:{i}".encode() for i in order] for row, order in zip(flat, top)], dtype=object)
    return strings.reshape(a.shape[:-1] + (k,))


assert "BYTES" not in DATATYPES  # inputs never take strings; BYTES is only an answer's type
