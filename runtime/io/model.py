"""lamina's model file format (version 2): one safetensors file, data only.

Tensors: one per distinct parameter, keyed by the parameter's name, stored as float32 or (with
`half=True`) float16, which loading widens to float32. A network that multiplies in another
precision (lamina.precision) stores its product weights (Layer.product_weights) in it: BF16 in a
bfloat16 network, I8 in an int8 one with each output channel's scale under 'scale/<name>'
(float32), so loading gives exactly the values the network had; a checkpoint stores every
parameter as float32 (training moves weights off the grid, and must resume exactly). Arrays among
the network's assets
are under 'asset/<name>'; in a checkpoint, optimizer state under 'optim/<parameter>/<state>'.
Metadata (all strings): format 'lamina', version '1', 'graph' (JSON:
  {"inputs": [{name, shape, dtype, sequence}], "layers": [{name, kind, config, params: {local: key},
   frozen: [local…]}], "nodes": [{name, layer, inputs}], "outputs": {name: value}}),
'assets' (JSON: the network's JSON-able assets, e.g. a vocabulary), and in a checkpoint
'checkpoint' (JSON: step counter, random-generator states, the caller's own fields).

Metadata also holds 'digest': sha256 over the whole file's content, every metadata entry (graph,
assets, checkpoint, format, version) and every tensor's name, type, shape and bytes. A version 2
file without it, or whose content does not match it, is refused, so a flipped bit anywhere (a
renamed node input that rewires the graph, a changed vocabulary word) is found. Version 1 files,
whose digest covered the tensors alone (and which older files lack), still load with that check.

Loading reads and checks everything (header size, format and version, the digest, the graph's
structure, every tensor named, none left over, finite values, shapes, configured parameter
shapes before they are allocated, JSON nesting) before it returns a network, and any
problem is a ModelFileError naming the file. NaN or infinity in a parameter is refused: a model
that produces NaN silently is worse than one that does not load. Saving writes a temporary file
in the same folder, fsyncs it, renames it over the target and fsyncs the folder, so a crash
leaves either the old file or the new one.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import tempfile
import time

import numpy as np
from safetensors import SafetensorError
from safetensors import TensorSpec, deserialize, serialize

from ..errors import ModelFileError, NonFiniteModelError
from ..graph import Network
from ..layers.base import REGISTRY, parameters_from_file
from ..precision import PRECISIONS, bfloat16_bits, dequantize_weight, from_bfloat16_bits, quantize_weight
from ..types import PathLike

FORMAT = "lamina"
VERSION = 2
LEGACY_VERSIONS = (1,)  # read, never written: their digest covers the tensors alone
# the tensor types a file may hold (safetensors' names): parameters are F32 or F16, assets any of these
TENSOR_TYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL")
NUMPY_TYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "I64": np.int64, "I32": np.int32,
               "I16": np.int16, "I8": np.int8, "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8,
               "BOOL": np.bool_}
# numpy has no bfloat16: a BF16 tensor is held as this one-field type over its 16-bit patterns (a type
# of its own, so that it is neither taken for nor digested as U16)
BFLOAT16 = np.dtype([("bfloat16", "<u2")])
MAX_HEADER = 64 << 20  # bytes of JSON header a model file may have
MAX_DEPTH = 32  # nesting of the graph JSON (a real graph nests about 6 levels)
ASSET, OPTIM, SCALE = "asset/", "optim/", "scale/"


# ---------------------------------------------------------------------------- writing

def describe(net, exact=False):
    """The graph of `net` as a JSON-able dict, and its parameter tensors by key: product weights
    in the network's precision, with their scales, or with exact=True (a checkpoint, which must
    resume training exactly) every parameter's float32 values."""
    graph = describe_graph(net)
    products = set() if exact else {layer.params[local].name for layer in net.layers
                                    for local in layer.product_weights()}
    tensors = {}
    for layer in net.layers:
        for p in layer.params.values():
            value = np.ascontiguousarray(p.value, dtype=np.float32)
            if p.name in products and net.precision == "bfloat16":
                tensors[p.name] = bfloat16_bits(value).view(BFLOAT16)
            elif p.name in products and net.precision == "int8":
                tensors[p.name], tensors[SCALE + p.name] = quantize_weight(value)
            else:
                tensors[p.name] = value
    return graph, tensors


def parameter_value(tensors, key):
    """The float32 values of the parameter stored under `key`, whatever its stored type."""
    stored = tensors[key]
    if stored.dtype == BFLOAT16:
        return from_bfloat16_bits(stored.view(np.uint16))
    if stored.dtype == np.int8:
        return dequantize_weight(stored, tensors[SCALE + key])
    return stored.astype(np.float32)


def describe_graph(net):
    """The graph of `net` as a JSON-able dict: inputs, layers (kind, configuration, parameter
    names, frozen ones), nodes and outputs."""
    net.validate()
    layers = []
    for layer in net.layers:
        keys = {local: p.name for local, p in layer.params.items()}
        layers.append({"name": layer.name, "kind": layer.kind, "config": layer.config(), "params": keys,
                       "frozen": [k for k, p in layer.params.items() if p.frozen]})
    dynamic = net.declared_dynamic_axes()
    graph = {
        "inputs": [{"name": n, "shape": list(net.values[n].spec.shape), "dtype": net.values[n].spec.kind,
                    "sequence": net.values[n].spec.sequence,
                    **({"dynamic": {str(a): s for a, s in dynamic[n].items()}} if n in dynamic else {})}
                   for n in net.input_names],
        "layers": layers,
        "nodes": [{"name": n.name, "layer": n.layer.name, "inputs": list(n.input_names)} for n in net.nodes],
        "outputs": dict(net.output_values),
    }
    if net.precision != "float32":  # (how inference multiplies; files of float32 networks stay as they were)
        graph["precision"] = net.precision
    return graph


def digest(tensors, metadata=None):
    """'sha256:<hex>' of the metadata's entries (all but 'digest' itself) and of every tensor's
    name, type, shape and bytes, in name order: stored in the metadata and checked on load.
    metadata None: the tensors alone (format version 1's digest)."""
    h = hashlib.sha256()
    if metadata is not None:
        entries = sorted((k, v) for k, v in metadata.items() if k != "digest")
        h.update(json.dumps(entries, ensure_ascii=False).encode() + b"\0")
    for key in sorted(tensors):
        a = np.ascontiguousarray(tensors[key])
        h.update(f"{key}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.data)
    return "sha256:" + h.hexdigest()


def _pack(net, half, extra_tensors=None, extra_metadata=None, exact=False):
    graph, tensors = describe(net, exact)
    for key in tensors:
        if not key.startswith(SCALE) and not np.isfinite(parameter_value(tensors, key)).all():
            raise NonFiniteModelError(f"parameter '{key}' holds NaN or infinity: the model was not written")
    if half:
        with np.errstate(over="ignore"):  # an overflow becomes inf, refused just below
            tensors = {k: v.astype(np.float16) if v.dtype == np.float32 and not k.startswith(SCALE) else v
                       for k, v in tensors.items()}
        for key, value in tensors.items():
            if not np.isfinite(value).all():
                raise NonFiniteModelError(f"parameter '{key}' exceeds float16's range (largest magnitude "
                                          f"65504): save it as float32; the model was not written")
    json_assets = {}
    for name, value in net.assets.items():
        if isinstance(value, np.ndarray):
            tensors[ASSET + name] = np.ascontiguousarray(value)
        else:
            json_assets[name] = value
    tensors.update(extra_tensors or {})
    metadata = {"format": FORMAT, "version": str(VERSION), "graph": json.dumps(graph, allow_nan=False),
                "assets": json.dumps(json_assets, allow_nan=False), **(extra_metadata or {})}
    metadata["digest"] = digest(tensors, metadata)
    return _serialize(tensors, metadata)


def stored_types(tensors):
    """The types a file's parameters are stored as ('float32', 'bfloat16', 'int8', ...), sorted."""
    return sorted({"bfloat16" if t.dtype == BFLOAT16 else str(t.dtype) for k, t in tensors.items()
                   if not k.startswith((ASSET, OPTIM, SCALE))})


def _serialize(tensors, metadata):
    """The safetensors bytes of numpy tensors (BFLOAT16 ones as BF16)."""
    held = {k: np.ascontiguousarray(v) for k, v in tensors.items()}  # (alive while serialize reads them)
    specs = {k: TensorSpec(dtype="bfloat16" if v.dtype == BFLOAT16 else v.dtype.name, shape=v.shape,
                           data_ptr=v.ctypes.data, data_len=v.nbytes) for k, v in held.items()}
    return bytes(serialize(specs, metadata=metadata))


def _deserialize(blob):
    """numpy tensors of safetensors bytes (BF16 ones as BFLOAT16); types were checked by the caller."""
    tensors = {}
    for key, view in deserialize(blob):
        dtype = BFLOAT16 if view["dtype"] == "BF16" else np.dtype(NUMPY_TYPES[view["dtype"]])
        tensors[key] = np.frombuffer(view["data"], dtype=dtype).reshape(view["shape"])
    return tensors


def _umask():
    """The process's umask, read without changing it (Linux), else by setting and restoring it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


TEMPORARY_PREFIX, TEMPORARY_SUFFIX = ".tmp-", ".lamina"
STALE_AFTER = 3600  # seconds after which a temporary without a writer's pid in its name is stale


def remove_stale_temporaries(folder):
    """Remove the temporary files that writers killed mid-save (kill -9, a power cut) left in
    `folder`: ours are named .tmp-<pid>-<random>.lamina, and one whose process is gone from this
    machine is stale (a name without a pid, from older versions: once an hour old)."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not (name.startswith(TEMPORARY_PREFIX) and name.endswith(TEMPORARY_SUFFIX)):
            continue
        path = os.path.join(folder, name)
        pid = name[len(TEMPORARY_PREFIX):].split("-", 1)[0]
        try:
            if pid.isdigit() and "-" in name[len(TEMPORARY_PREFIX):]:
                if _alive(int(pid)):
                    continue
            elif time.time() - os.stat(path).st_mtime < STALE_AFTER:
                continue
            os.unlink(path)
        except OSError:
            pass  # gone meanwhile, or not ours to remove


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def write_atomic(path, blob):
    """Write bytes to path so that a crash leaves the old file or the new one, never a mix (and
    the temporaries of earlier writers killed mid-save in that folder are removed)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(folder)
    fd, tmp = tempfile.mkstemp(prefix=f"{TEMPORARY_PREFIX}{os.getpid()}-", suffix=TEMPORARY_SUFFIX, dir=folder)
    try:
        # mkstemp makes the file 0600: give it the mode of the file it replaces, or the
        # umask's default for a new file, as open() would
        try:
            mode = os.stat(path).st_mode & 0o7777
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        os.fchmod(fd, mode)
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


def save(net: Network, path: PathLike, half: bool = False) -> None:
    """Write `net` (graph, parameters, assets) to `path` atomically; half=True stores the
    parameters as float16 (half the size; loading widens them to float32)."""
    write_atomic(path, _pack(net, half))


# ---------------------------------------------------------------------------- reading

def _read(path):
    """(metadata, tensors) of a lamina file, with the envelope checked."""
    try:
        with open(path, "rb") as f:
            blob = f.read()
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the model file ({e.strerror})") from None
    if len(blob) < 8:
        raise ModelFileError(f"{path}: not a safetensors file (only {len(blob)} bytes)")
    header_len = int.from_bytes(blob[:8], "little")
    if header_len > MAX_HEADER:
        raise ModelFileError(f"{path}: the header claims {header_len} bytes; at most {MAX_HEADER} are allowed")
    if 8 + header_len > len(blob):
        raise ModelFileError(f"{path}: truncated: the header claims {header_len} bytes, the file has "
                             f"{len(blob) - 8} after the length")
    try:
        header = json.loads(blob[8:8 + header_len])
        metadata = header.get("__metadata__") or {}
        for key, entry in header.items():
            if key != "__metadata__" and isinstance(entry, dict) and entry.get("dtype") not in TENSOR_TYPES:
                raise ModelFileError(f"{path}: tensor '{key}' has type {entry.get('dtype')!r}; a lamina model file "
                                     f"holds {', '.join(TENSOR_TYPES)} tensors (parameters: F32, F16, BF16 or I8)")
        tensors = _deserialize(blob)
    except ModelFileError:
        raise
    except (SafetensorError, ValueError, UnicodeDecodeError, AttributeError, RecursionError, KeyError) as e:
        raise ModelFileError(f"{path}: not a safetensors file ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, dict) or metadata.get("format") != FORMAT:
        found = metadata.get("format") if isinstance(metadata, dict) else metadata
        raise ModelFileError(f"{path}: expected format '{FORMAT}' in the metadata, found {found!r}")
    version = metadata.get("version")
    if version == str(VERSION):
        if "digest" not in metadata:
            raise ModelFileError(f"{path}: the metadata has no 'digest'; every version {VERSION} file carries one "
                                 f"(the file was damaged or edited): restore it from a copy")
        expected = digest(tensors, metadata)
    elif version in map(str, LEGACY_VERSIONS):
        expected = digest(tensors) if "digest" in metadata else None  # written before digests existed
    else:
        raise ModelFileError(f"{path}: expected format version {VERSION} (or {', '.join(map(str, LEGACY_VERSIONS))}), "
                             f"found {version!r}")
    if expected is not None and metadata["digest"] != expected:
        raise ModelFileError(f"{path}: the file's content does not match the digest stored with it: the file is "
                             f"damaged (or was edited); restore it from a copy")
    return metadata, tensors


def _json(path, metadata, key, default=None):
    if key not in metadata:
        if default is not None:
            return default
        raise ModelFileError(f"{path}: the metadata has no '{key}'")
    try:
        value = json.loads(metadata[key], parse_constant=_no_constant)
    except (ValueError, RecursionError, TypeError) as e:
        raise ModelFileError(f"{path}: the metadata's '{key}' is not JSON of a sane depth ({type(e).__name__}: "
                             f"{e})") from None
    problem = json_problem(value)
    if problem:
        raise ModelFileError(f"{path}: the metadata's '{key}' {problem}")
    return value


def _no_constant(name):
    raise ValueError(f"{name} is not a number JSON allows")


def json_problem(value):
    """What makes a parsed JSON value unfit for a model file, or None: nesting deeper than
    MAX_DEPTH, or a number that is not finite (1e999 parses as infinity). Walked iteratively: no
    recursion limit to hit."""
    stack = [(value, 1, "")]
    while stack:
        v, d, where = stack.pop()
        if d > MAX_DEPTH:
            return f"is nested more than {MAX_DEPTH} levels deep; a model needs far fewer"
        if isinstance(v, float) and not math.isfinite(v):
            return f"holds the non-finite number {v} at {where or 'its top'}"
        if isinstance(v, dict):
            stack.extend((x, d + 1, f"{where}.{k}" if where else str(k)) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((x, d + 1, f"{where}[{i}]") for i, x in enumerate(v))
    return None


def _check_graph(path, graph, tensors):
    """Structure, names and tensors of a graph description (tensors None: a description with
    fresh parameters); raises ModelFileError."""
    def fail(msg):
        raise ModelFileError(f"{path}: {msg}")

    def need(obj, kind, what):
        if not isinstance(obj, kind):
            fail(f"{what} must be a {kind.__name__}, found {type(obj).__name__}")
        return obj

    need(graph, dict, "the graph")
    for key, kind in (("inputs", list), ("layers", list), ("nodes", list), ("outputs", dict)):
        need(graph.get(key), kind, f"the graph's '{key}'")
    for i, spec in enumerate(graph["inputs"]):
        need(spec, dict, f"input {i}")
        need(spec.get("name"), str, f"input {i}'s name")
        need(spec.get("shape"), list, f"input '{spec['name']}''s shape")
        for axis, symbol in need(spec.get("dynamic", {}), dict, f"input '{spec['name']}''s dynamic axes").items():
            if not (axis.isdigit() and int(axis) < len(spec["shape"]) and isinstance(symbol, str)):
                fail(f"input '{spec['name']}''s dynamic axes must map an axis of its shape {spec['shape']} to a "
                     f"symbol, found {axis!r}: {symbol!r}")
    used = set()
    for i, spec in enumerate(graph["layers"]):
        need(spec, dict, f"layer {i}")
        name = need(spec.get("name"), str, f"layer {i}'s name")
        if spec.get("kind") not in REGISTRY:
            fail(f"layer '{name}' has unknown kind {spec.get('kind')!r}; known: {', '.join(sorted(REGISTRY))}")
        need(spec.get("config", {}), dict, f"layer '{name}''s config")
        for local, key in need(spec.get("params", {}), dict, f"layer '{name}''s params").items():
            if tensors is None:
                continue
            if not isinstance(key, str) or key not in tensors or key.startswith((ASSET, OPTIM, SCALE)):
                fail(f"layer '{name}' parameter '{local}' refers to tensor {key!r}, which the file lacks")
            stored = tensors[key]
            if stored.dtype not in (np.float32, np.float16, BFLOAT16, np.int8):
                fail(f"tensor '{key}' must be F32, F16, BF16 or I8, found {stored.dtype}")
            if stored.dtype == np.int8:
                scale = tensors.get(SCALE + key)
                expected = (stored.shape[0],) if stored.ndim else None
                if scale is None or scale.dtype != np.float32 or scale.shape != expected:
                    fail(f"int8 tensor '{key}' needs its scales: a float32 tensor '{SCALE}{key}' of shape {expected}, "
                         f"found {'none' if scale is None else f'{scale.dtype} of shape {scale.shape}'}")
                if not np.all(np.isfinite(scale)) or np.any(scale < 0):
                    fail(f"tensor '{SCALE}{key}' must hold finite scales of at least 0")
                used.add(SCALE + key)
            if not np.all(np.isfinite(parameter_value(tensors, key))):
                fail(f"tensor '{key}' contains NaN or infinity (refused: fix or retrain the model)")
            used.add(key)
    layer_names = {spec["name"] for spec in graph["layers"]}
    for i, node in enumerate(graph["nodes"]):
        need(node, dict, f"node {i}")
        if node.get("layer") not in layer_names:
            fail(f"node '{node.get('name')}' uses layer '{node.get('layer')}', which the file does not define")
        need(node.get("inputs"), list, f"node '{node.get('name')}''s inputs")
    extra = [k for k in tensors or () if k not in used and not k.startswith((ASSET, OPTIM))]
    if extra:
        fail(f"tensor '{extra[0]}' belongs to no layer (extra tensors: {len(extra)})")


def _build(path, graph, tensors):
    net = Network()
    precision = graph.get("precision", "float32")
    if precision not in PRECISIONS:
        raise ModelFileError(f"{path}: precision must be one of {', '.join(PRECISIONS)}, found {precision!r}")
    net.precision = precision
    for spec in graph["inputs"]:
        net.input(spec["name"], spec["shape"], spec.get("dtype", "float"), spec.get("sequence", False),
                  {int(a): s for a, s in spec.get("dynamic", {}).items()})
    layers, shared = {}, {}
    keys = {spec["name"]: spec.get("params", {}) for spec in graph["layers"]}

    def declared_shape(layer, local, shape):
        """The shape the file holds for this parameter, checked against the configured one before
        anything of that size is allocated."""
        key = keys.get(layer.name, {}).get(local)
        if key is None:
            raise ModelFileError(f"{path}: layer '{layer.name}' has no tensor for parameter '{local}'")
        if tuple(tensors[key].shape) != shape:
            raise ModelFileError(f"{path}: layer '{layer.name}': its configuration gives parameter '{local}' "
                                 f"the shape {shape}, the file's tensor '{key}' has {tuple(tensors[key].shape)}")
        return shape

    for spec in graph["layers"]:
        if tensors is None:
            layer = REGISTRY[spec["kind"]](**spec.get("config", {}), name=spec["name"])
        else:
            with parameters_from_file(declared_shape):
                layer = REGISTRY[spec["kind"]](**spec.get("config", {}), name=spec["name"])
        for local, key in spec.get("params", {}).items():
            p = layer.params.get(local)
            if p is None:
                raise ModelFileError(f"{path}: layer '{spec['name']}' has no parameter '{local}'")
            if key in shared:
                layer.tie(local, shared[key])
            elif tensors is None:  # a description: keep the fresh initial values
                p.name = key
                shared[key] = p
            else:
                if tensors[key].shape != p.shape:
                    raise ModelFileError(f"{path}: tensor '{key}' has shape {tensors[key].shape}; layer "
                                         f"'{spec['name']}' expects {p.shape} for '{local}'")
                p.assign(parameter_value(tensors, key))
                p.name = key
                shared[key] = p
            p.frozen = local in spec.get("frozen", [])
        missing = [local for local in layer.params if local not in spec.get("params", {})]
        if missing:
            raise ModelFileError(f"{path}: layer '{spec['name']}' has no tensor for parameter '{missing[0]}'")
        layers[spec["name"]] = layer
    for node in graph["nodes"]:
        net.add(layers[node["layer"]], node["inputs"], name=node.get("name"))
    net.outputs(**graph["outputs"])
    net.validate()
    return net


def _load(path):
    """(network, metadata, tensors) of a model or checkpoint file."""
    metadata, tensors = _read(path)
    graph = _json(path, metadata, "graph")
    assets = _json(path, metadata, "assets", default={})
    try:
        _check_graph(path, graph, tensors)
        net = _build(path, graph, tensors)
        if not isinstance(assets, dict):
            raise ModelFileError(f"{path}: the metadata's 'assets' must be a JSON object")
    except ModelFileError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        raise ModelFileError(f"{path}: the graph does not describe a valid network: {e}") from None
    net.assets = {**assets, **{k[len(ASSET):]: v for k, v in tensors.items() if k.startswith(ASSET)}}
    return net, metadata, tensors


ONNX_SUFFIXES = (".onnx",)


def load(path: PathLike) -> Network:
    """Read a model file: lamina's own (written by `save`, or a checkpoint), or an ONNX model
    (by its .onnx suffix, or, under another name, its content); returns a validated Network. A
    file of neither kind is a ModelFileError that names what the file looks like."""
    kind = "onnx" if str(path).endswith(ONNX_SUFFIXES) else "lamina" if str(path).endswith(".lamina") else sniff(path)
    if kind == "onnx":
        from .onnx import load as load_onnx
        return load_onnx(path)
    if kind not in ("lamina", None):  # (a .lamina file is read as one: its damage is named precisely)
        raise ModelFileError(f"{path}: not a model file: it looks like {kind}; lamina loads its own model "
                             f"files (.lamina, written by lamina.save) and ONNX models (.onnx)")
    return _load(path)[0]


def sniff(path):
    """What a file looks like from its first bytes: 'lamina' (a safetensors header), 'onnx' (a
    protobuf ModelProto: field 1, ir_version, first), or a phrase for another kind; None where it
    cannot be read (the loader then says why)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError:
        return None
    if len(head) >= 9 and int.from_bytes(head[:8], "little") < MAX_HEADER and head[8:9] == b"{":
        return "lamina"
    if head[:1] == b"\x08" and len(head) > 1 and head[1] < 0x80:
        return "onnx"
    text = head.lstrip()
    if head.startswith(b"PK\x03\x04"):
        return "a zip archive (a PyTorch .pt/.pth or a numpy .npz?)"
    if head.startswith(b"\x80") and len(head) > 1 and head[1] <= 5:
        return "a Python pickle (PyTorch's legacy format?), which lamina never loads: it can run code"
    if text.startswith((b"{", b"[")):
        return "JSON text (a description written by save_description? load it with lamina.io.load_description)"
    try:
        head.decode("utf-8")
        return "a text file"
    except UnicodeDecodeError:
        return "binary data of an unknown kind"


def save_description(net: Network, path: PathLike) -> None:
    """Write the network's graph (no parameters) as JSON: `load_description` builds it again
    with freshly initialised parameters (`lamina train` accepts such a file as its MODEL)."""
    graph, _ = describe(net)
    write_atomic(path, (json.dumps({"format": FORMAT, "version": VERSION, "graph": graph}, indent=1) + "\n").encode())


def load_description(path: PathLike) -> Network:
    """A Network from a JSON description written by save_description, parameters initialised
    afresh (lamina.manual_seed makes them repeatable)."""
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f, parse_constant=_no_constant)
    except OSError as e:
        raise ModelFileError(f"{path}: cannot read the description ({e.strerror})") from None
    except (ValueError, RecursionError) as e:
        raise ModelFileError(f"{path}: the description is not JSON of a sane depth ({type(e).__name__}: {e})") from None
    if (not isinstance(doc, dict) or doc.get("format") != FORMAT
            or doc.get("version") not in (VERSION, *LEGACY_VERSIONS)):
        raise ModelFileError(f"{path}: expected a JSON object with format '{FORMAT}' and version {VERSION}")
    problem = json_problem(doc)
    if problem:
        raise ModelFileError(f"{path}: the description {problem}")
    try:
        _check_graph(path, doc.get("graph"), None)
        return _build(path, doc["graph"], None)
    except ModelFileError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, IndexError, OverflowError, RecursionError) as e:
        raise ModelFileError(f"{path}: the description does not describe a valid network: {e}") from None
