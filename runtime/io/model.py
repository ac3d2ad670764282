"""lamina's model file format (version 1).

safetensors tensors: one per distinct parameter, keyed by the parameter's name.
safetensors metadata: {"format": "lamina", "version": "1", "graph": JSON} with the graph
  {"dtype", "inputs": [{name, shape, dtype}], "layers": [{name, kind, config, params: {local: key},
   frozen: [local…]}], "nodes": [{name, layer, inputs}], "outputs": {name: value}}.
"""
import json
import os
import tempfile

import numpy as np
from safetensors import SafetensorError
from safetensors.numpy import load as st_load
from safetensors.numpy import save as st_save

from ..graph import Network
from ..layers.base import REGISTRY

FORMAT = "lamina"
VERSION = 1


class ModelFileError(ValueError):
    """A model file that cannot be loaded; the message names the file and the problem."""


def describe(net):
    """The graph of `net` as a JSON-able dict, and its tensors by key."""
    net.validate()
    tensors, layers = {}, []
    for layer in net.layers:
        keys = {}
        for local, p in layer.params.items():
            keys[local] = p.name
            tensors[p.name] = np.ascontiguousarray(p.value, dtype=np.float32)
        layers.append({"name": layer.name, "kind": layer.kind, "config": layer.config(), "params": keys,
                       "frozen": [k for k, p in layer.params.items() if p.frozen]})
    graph = {
        "inputs": [{"name": n, "shape": list(net.values[n].spec.shape), "dtype": net.values[n].spec.kind,
                    "sequence": net.values[n].spec.sequence} for n in net.input_names],
        "layers": layers,
        "nodes": [{"name": n.name, "layer": n.layer.name, "inputs": list(n.input_names)} for n in net.nodes],
        "outputs": dict(net.output_values),
    }
    return graph, tensors


def save(net, path):
    """Write `net` to `path` atomically."""
    graph, tensors = describe(net)
    blob = st_save(tensors, metadata={"format": FORMAT, "version": str(VERSION), "graph": json.dumps(graph)})
    folder = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".lamina", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _read(path):
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the model file ({e.strerror})") from None
    try:
        tensors = st_load(blob)
        header_len = int.from_bytes(blob[:8], "little")
        metadata = json.loads(blob[8:8 + header_len]).get("__metadata__") or {}
    except (SafetensorError, ValueError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not a safetensors file ({e})") from None
    if metadata.get("format") != FORMAT:
        raise ModelFileError(f"{path}: expected format '{FORMAT}' in the metadata, found {metadata.get('format')!r}")
    if metadata.get("version") != str(VERSION):
        raise ModelFileError(f"{path}: expected format version {VERSION}, found {metadata.get('version')!r}")
    try:
        graph = json.loads(metadata["graph"])
    except (KeyError, ValueError) as e:
        raise ModelFileError(f"{path}: the graph description is missing or not JSON ({e})") from None
    return graph, tensors


def _validate(path, graph, tensors):
    def fail(msg):
        raise ModelFileError(f"{path}: {msg}")

    for key in ("inputs", "layers", "nodes", "outputs"):
        if key not in graph:
            fail(f"the graph has no '{key}'")
    layer_names = set()
    for spec in graph["layers"]:
        if spec.get("kind") not in REGISTRY:
            fail(f"layer '{spec.get('name')}' has unknown kind {spec.get('kind')!r}; known: {', '.join(sorted(REGISTRY))}")
        for local, key in spec.get("params", {}).items():
            if key not in tensors:
                fail(f"layer '{spec['name']}' parameter '{local}' refers to tensor '{key}', which the file lacks")
            if not np.all(np.isfinite(tensors[key])):
                fail(f"tensor '{key}' contains NaN or infinity")
        layer_names.add(spec["name"])
    for node in graph["nodes"]:
        if node.get("layer") not in layer_names:
            fail(f"node '{node.get('name')}' uses layer '{node.get('layer')}', which the file does not define")


def load(path):
    """Read a model file written by `save`; returns a validated Network."""
    graph, tensors = _read(path)
    _validate(path, graph, tensors)
    net = Network()
    try:
        for spec in graph["inputs"]:
            net.input(spec["name"], spec["shape"], spec["dtype"], spec.get("sequence", False))
        layers, shared = {}, {}
        for spec in graph["layers"]:
            layer = REGISTRY[spec["kind"]](**spec["config"], name=spec["name"])
            for local, key in spec["params"].items():
                p = layer.params.get(local)
                if p is None:
                    raise ModelFileError(f"{path}: layer '{spec['name']}' has no parameter '{local}'")
                if key in shared:
                    layer.tie(local, shared[key])
                else:
                    p.assign(tensors[key].astype(np.float32))
                    p.name = key
                    shared[key] = p
                p.frozen = local in spec.get("frozen", [])
            layers[spec["name"]] = layer
        for node in graph["nodes"]:
            net.add(layers[node["layer"]], node["inputs"], name=node["name"])
        net.outputs(**graph["outputs"])
        net.validate()
    except ModelFileError:
        raise
    except (TypeError, ValueError, KeyError) as e:
        raise ModelFileError(f"{path}: the graph does not describe a valid network: {e}") from None
    return net
