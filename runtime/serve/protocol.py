"""The Open Inference Protocol (KServe v2) on the wire: tensors in JSON or in the binary tensor
data extension, checked against a model's inputs, and the model's metadata.

A request carries one sample per row of each input, stacked on the first axis ([n, *shape]).
A model with sequence inputs takes one sequence per request, or several: each sequence input is
that sequence's steps ([steps, *shape]) and every other input one row ([1, *shape]); or each
sequence input is a padded batch ([n, T, *shape]) whose lengths the request's parameters give
("sequence_lengths": [l1, ..., ln], each in 1..T, or over gRPC the string "l1,...,ln"; absent:
every sequence T steps), and every other input n rows. Responses carry each output for this
request's rows alone, in the same layout: a sequence output of a padded request padded to
[n, T, *shape] with zeros past each length (as ONNX Runtime pads).

Binary extension: the header `Inference-Header-Content-Length: N` says the body's first N bytes
are the JSON; an input with `"parameters": {"binary_data_size": k}` takes the next k bytes
(little-endian, C order). A request asks for binary outputs with `"parameters":
{"binary_data_output": true}`, or per output with `{"name": ..., "parameters": {"binary_data":
true}}`; such an output's JSON carries `binary_data_size` and its bytes follow the JSON.
"""
import json
import math
from dataclasses import dataclass

import numpy as np

from ..errors import ProtocolError

HEADER_LENGTH = "inference-header-content-length"

DATATYPES = {"BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
             "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64, "FP16": np.float16,
             "FP32": np.float32, "FP64": np.float64}
NAMES = {np.dtype(v): k for k, v in DATATYPES.items()}


@dataclass(frozen=True)
class Limits:
    """The work one request may ask for, checked before it is queued (413 past a limit, naming
    it and the option that sets it): steps of a sequence, rows of a batch input, and values
    across all of a request's inputs, and again across all of its answer's outputs."""
    max_sequence_length: int = 4096
    max_rows: int = 1024
    max_elements: int = 1 << 22

    def check(self, name, shape, sequence, padded, total):
        """Refuse input `name` of `shape` (a sequence's steps first; a padded batch of sequences
        [n, T, ...]; else rows) when it passes a limit; `total`: the request's values so far,
        this input's included."""
        rows, steps = (shape[0], shape[1]) if padded else (None, shape[0]) if sequence else (shape[0], None)
        if steps is not None and steps > self.max_sequence_length:
            raise ProtocolError(f"input '{name}': a sequence of {steps} steps; this server takes at most "
                                f"{self.max_sequence_length} (--max-sequence-length)", 413)
        if rows is not None and rows > self.max_rows:
            raise ProtocolError(f"input '{name}': {rows} {'sequences' if padded else 'rows'}; this server takes "
                                f"at most {self.max_rows} rows per request (--max-rows)", 413)
        if total > self.max_elements:
            raise ProtocolError(f"the request's inputs hold {total} values (through input '{name}'); this server "
                                f"takes at most {self.max_elements} per request (--max-elements)", 413)

    def check_outputs(self, counts):
        """Refuse an answer whose outputs ({name: values}) hold more than max_elements values."""
        total = sum(counts.values())
        if total > self.max_elements:
            listed = ", ".join(f"'{name}' {n}" for name, n in counts.items())
            raise ProtocolError(f"the answer would hold {total} values ({listed}); this server sends at most "
                                f"{self.max_elements} per request (--max-elements): ask for fewer outputs or "
                                f"send less", 413)


def parameters(entry, where):
    """The protocol's optional `parameters` object of a request, input or output: {} when
    absent, a ProtocolError when it is anything but an object."""
    params = entry.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ProtocolError(f"{where}: 'parameters' must be an object, found {type(params).__name__} {params!r:.40}")
    return params


def datatype(dtype):
    return NAMES[np.dtype(dtype)]


def spec_datatype(spec):
    """The datatype of a value of this Spec: FP32, or INT32 for lamina's integer values."""
    return "FP32" if spec.kind == "float" else "INT32"


def model_metadata(name, model):
    """GET /v2/models/{name}: inputs and outputs with names, datatypes and shapes (-1: any size,
    the batch's, a sequence's steps or an input's dynamic axes (Network.dynamic_axes);
    a sequence input or output marked with parameters.sequence, an input a request may leave
    out (zeros) with parameters.optional, each output's inputs listed in parameters.inputs)."""
    def tensor(vname, spec):
        dynamic = net.dynamic_axes.get(vname, {})
        entry = {"name": vname, "datatype": spec_datatype(spec),
                 "shape": [-1, *(-1 if i in dynamic else size for i, size in enumerate(spec.shape))]}
        if spec.sequence:
            entry["parameters"] = {"sequence": True}
        return entry
    net = model.net
    inputs = [tensor(v, net.values[v].spec) for v in model.inputs]
    for entry in inputs:
        if entry["name"] in model.optional:  # a recurrent layer's initial state: zeros when left out
            entry["parameters"] = {**entry.get("parameters", {}), "optional": True}
    outputs = [tensor(o, net.values[net.output_values[o]].spec) for o in model.outputs]
    for entry in outputs:  # which inputs a request for this output sends (the LM's nll needs next)
        entry["parameters"] = {**entry.get("parameters", {}), "inputs": model.reads[entry["name"]]}
    return {"name": name, "versions": ["1"], "platform": "lamina", "inputs": inputs, "outputs": outputs,
            "parameters": {"max_batch_size": model.max_batch_size, "sequence_model": model.sequence_model}}


def parse_request(body, headers):
    """(request JSON, the binary tail) of an /infer body (its size already bounded where it was
    read: app.read_body); ProtocolError for a malformed one."""
    size = headers.get(HEADER_LENGTH)
    if size is not None:
        try:
            size = int(size)
        except ValueError:
            raise ProtocolError(f"header Inference-Header-Content-Length must be an integer, found {size!r}") from None
        if not 0 <= size <= len(body):
            raise ProtocolError(f"header Inference-Header-Content-Length is {size}, the body holds {len(body)} bytes")
    head, tail = (body, b"") if size is None else (body[:size], body[size:])
    try:
        request = json.loads(head)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ProtocolError(f"the request is not valid JSON: {e}") from None
    except RecursionError:
        raise ProtocolError("the request's JSON nests too deeply (arrays or objects within each other)") from None
    if not isinstance(request, dict):
        raise ProtocolError(f"the request must be a JSON object, found {type(request).__name__}")
    if not isinstance(request.get("inputs"), list) or not request["inputs"]:
        raise ProtocolError("the request must hold a non-empty list 'inputs'")
    parameters(request, "the request")
    return request, tail


def decode_inputs(request, tail, model):
    """{input name: numpy array} of a request, checked against the model: known names, no
    duplicates, datatypes, shapes, the work limits (model.limits) before any array is made, data
    sizes, finite floats; ProtocolError naming the input."""
    arrays, offset, total = {}, 0, 0
    for i, entry in enumerate(request["inputs"]):
        where = f"inputs[{i}]"
        if not isinstance(entry, dict):
            raise ProtocolError(f"{where} must be an object with name, shape, datatype and data")
        name = entry.get("name")
        if not isinstance(name, str) or name not in model.inputs:
            raise ProtocolError(f"{where}: unknown input {name!r}; the model's inputs are "
                                f"{', '.join(repr(n) for n in model.inputs)}")
        if name in arrays:
            raise ProtocolError(f"{where}: input '{name}' is given twice")
        where = f"input '{name}'"
        kind = entry.get("datatype")
        if not isinstance(kind, str) or kind not in DATATYPES:
            raise ProtocolError(f"{where}: unknown datatype {kind!r}; expected one of {', '.join(DATATYPES)}")
        shape = entry.get("shape")
        if (not isinstance(shape, list) or not shape
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise ProtocolError(f"{where}: shape must be a non-empty list of sizes >= 0, found {shape!r}")
        count = math.prod(shape)  # Python's integers: a product past int64 is refused, never wrapped
        total += count
        spec = model.net.values[name].spec
        padded = spec.sequence and len(shape) == len(spec.shape) + 2
        model.limits.check(name, shape, spec.sequence, padded, total)
        dtype = np.dtype(DATATYPES[kind])
        params = parameters(entry, where)
        if "binary_data_size" in params:
            size = params["binary_data_size"]
            if not isinstance(size, int) or size < 0 or offset + size > len(tail):
                raise ProtocolError(f"{where}: binary_data_size {size!r} does not fit the {len(tail) - offset} "
                                    f"bytes left in the body")
            if size != count * dtype.itemsize:
                raise ProtocolError(f"{where}: shape {shape} of {kind} needs {count * dtype.itemsize} bytes, "
                                    f"binary_data_size is {size}")
            a = np.frombuffer(tail, dtype.newbyteorder("<"), count, offset).astype(dtype).reshape(shape)
            offset += size
        else:
            a = _from_json(entry.get("data"), dtype, shape, count, where)
        arrays[name] = _check_input(model, name, kind, a, where)
    if offset != len(tail):
        raise ProtocolError(f"the body holds {len(tail) - offset} bytes after the inputs' binary data")
    return arrays


def _from_json(data, dtype, shape, count, where):
    if data is None:
        raise ProtocolError(f"{where}: no 'data' (nor parameters.binary_data_size)")
    try:
        a = np.array(data, dtype=np.float64 if dtype.kind == "f" else object)
    except (ValueError, TypeError):
        raise ProtocolError(f"{where}: data must be numbers, flat or nested as the shape") from None
    if a.size != count:
        raise ProtocolError(f"{where}: shape {shape} needs {count} values, data holds {a.size}")
    flat = a.reshape(-1)
    if dtype.kind in "iub":
        ok = all(isinstance(v, (int, bool)) and not (dtype.kind != "b" and isinstance(v, bool)) for v in flat)
        if not ok:
            raise ProtocolError(f"{where}: {datatype(dtype)} data must be whole numbers")
        info = np.iinfo(dtype) if dtype.kind != "b" else None
        if info is not None and any(v < info.min or v > info.max for v in flat):
            raise ProtocolError(f"{where}: a value does not fit {datatype(dtype)}")
    with np.errstate(over="ignore"):  # a float past the type's range becomes infinity, refused later
        return flat.astype(dtype).reshape(shape)


def _check_input(model, name, kind, a, where):
    spec = model.net.values[name].spec
    if spec.kind == "float":
        if kind != "FP32":
            raise ProtocolError(f"{where}: expected datatype FP32, found {kind}")
        if not np.all(np.isfinite(a)):
            raise ProtocolError(f"{where}: values must be finite, found NaN or infinity")
    elif a.dtype.kind not in "iu":
        raise ProtocolError(f"{where}: expected integer ids (INT32 or another integer type), found {kind}")
    padded = spec.sequence and a.ndim == len(spec.shape) + 2
    dynamic = model.net.dynamic_axes.get(name, {})
    sample = a.shape[2 if padded else 1:]
    if len(sample) != len(spec.shape) or any(n != size for i, (n, size) in enumerate(zip(sample, spec.shape))
                                             if i not in dynamic) or 0 in sample:
        per = ", ".join(str(-1 if i in dynamic else size) for i, size in enumerate(spec.shape))
        if spec.sequence:
            raise ProtocolError(f"{where}: expected shape [steps{', ' + per if per else ''}] (one sequence: its "
                                f"steps) or [n, T{', ' + per if per else ''}] (n sequences padded to T steps), "
                                f"found {list(a.shape)}")
        raise ProtocolError(f"{where}: expected shape [n, {per}], found {list(a.shape)}")
    if 0 in a.shape[:2 if padded else 1]:
        raise ProtocolError(f"{where}: no rows (an empty {'sequence' if spec.sequence else 'batch'})")
    return a


def sequences_of(request, arrays, model):
    """The request's padded sequences, {sequence input: list of each sequence's steps}, from a
    padded batch ([n, T, ...]) and the request's parameters.sequence_lengths; None for a request
    of one sequence ([steps, ...]) or to a model without sequence inputs. The other inputs must
    hold a row per sequence."""
    if not model.sequence_model:
        return None
    sequence_inputs = [k for k in arrays if model.net.values[k].spec.sequence]
    if not sequence_inputs:
        return None
    forms = {k: arrays[k].ndim == len(model.net.values[k].spec.shape) + 2 for k in sequence_inputs}
    shapes = {k: arrays[k].shape[:2 if forms[k] else 1] for k in sequence_inputs}
    if len(set(shapes.values())) > 1 or len(set(forms.values())) > 1:
        raise ProtocolError(f"the sequence inputs differ in their sequences: {shapes}")
    lengths = parameters(request, "the request").get("sequence_lengths")
    if isinstance(lengths, str):  # "6,2,4": gRPC's parameters carry no lists
        try:
            lengths = [int(n) for n in lengths.split(",")]
        except ValueError:
            raise ProtocolError(f"parameters.sequence_lengths must be whole numbers separated by commas, found "
                                f"{lengths!r:.80}") from None
    if not any(forms.values()):
        if lengths is not None:
            raise ProtocolError("parameters.sequence_lengths is for padded sequence inputs ([n, T, ...]); these "
                                "inputs hold one sequence each")
        count, split = 1, {k: [arrays[k]] for k in sequence_inputs}
    else:
        count, steps = next(iter(shapes.values()))
        if lengths is None:
            lengths = [steps] * count
        if (not isinstance(lengths, list) or len(lengths) != count
                or not all(isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= steps for n in lengths)):
            raise ProtocolError(f"parameters.sequence_lengths must list {count} lengths in 1..{steps} (one per "
                                f"padded sequence), found {lengths!r:.80}")
        split = {k: [arrays[k][i, :n] for i, n in enumerate(lengths)] for k in sequence_inputs}
    for k, a in arrays.items():
        if k not in split and a.shape[0] != count:
            raise ProtocolError(f"input '{k}': a request of {count} sequence(s) takes {count} row(s) of this input, "
                                f"found {a.shape[0]}")
    return split if any(forms.values()) else None


def requested_outputs(request, model):
    """(output names, which of them go binary, {output: classes asked}): the listed outputs,
    else every output the given inputs compute; an output's parameters.classification (the
    classification extension) asks for its k best classes instead of its values."""
    binary_all = bool(parameters(request, "the request").get("binary_data_output", False))
    listed = request.get("outputs")
    if listed is None:
        return None, binary_all, {}
    if not isinstance(listed, list) or not listed:
        raise ProtocolError("'outputs' must be a non-empty list of {\"name\": ...} objects")
    names, binary, classes = [], set(), {}
    for i, entry in enumerate(listed):
        name = entry.get("name") if isinstance(entry, dict) else None
        if not isinstance(name, str) or name not in model.outputs:
            raise ProtocolError(f"outputs[{i}]: unknown output {name!r}; the model's outputs are "
                                f"{', '.join(repr(n) for n in model.outputs)}")
        names.append(name)
        params = parameters(entry, f"outputs[{i}]")
        if binary_all or params.get("binary_data"):
            binary.add(name)
        k = params.get("classification")
        if k is not None:
            if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                raise ProtocolError(f"outputs[{i}]: parameters.classification must be a class count of at least 1, "
                                    f"found {k!r}")
            classes[name] = k
    return names, binary if not binary_all else True, classes


def tensor_entry(name, a, binary):
    """A tensor's JSON entry: its data inline, or (binary) its byte count, its bytes to follow
    the JSON (encode_body). An array of bytes objects is the protocol's BYTES (inline as
    strings; binary as each element's 4-byte little-endian length and its bytes)."""
    if a.dtype == object:
        entry = {"name": name, "datatype": "BYTES", "shape": list(a.shape)}
        if binary:
            entry["parameters"] = {"binary_data_size": len(bytes_body(a))}
        else:
            entry["data"] = [v.decode() for v in a.reshape(-1)]
        return entry
    entry = {"name": name, "datatype": datatype(a.dtype), "shape": list(a.shape)}
    if binary:
        entry["parameters"] = {"binary_data_size": a.size * a.dtype.itemsize}
    else:
        entry["data"] = a.reshape(-1).tolist()
    return entry


def bytes_body(a):
    """The binary form of a BYTES tensor: each element's length (4 bytes, little-endian) and
    its bytes."""
    return b"".join(len(v).to_bytes(4, "little") + v for v in a.reshape(-1))


def encode_body(head, raw):
    """(body, headers): the JSON `head`, then the arrays in `raw` as little-endian bytes, written
    straight from the arrays into one buffer (the binary tensor data extension)."""
    text = json.dumps(head, separators=(",", ":")).encode()
    if not raw:
        return text, {"content-type": "application/json"}
    raw = [bytes_body(a) if a.dtype == object else a for a in raw]
    body = bytearray(len(text) + sum(len(a) if isinstance(a, bytes) else a.size * a.dtype.itemsize for a in raw))
    body[:len(text)] = text
    offset = len(text)
    for a in raw:
        if isinstance(a, bytes):
            body[offset:offset + len(a)] = a
            offset += len(a)
            continue
        np.frombuffer(body, a.dtype.newbyteorder("<"), a.size, offset).reshape(a.shape)[...] = a
        offset += a.size * a.dtype.itemsize
    return memoryview(body), {"content-type": "application/octet-stream", HEADER_LENGTH: str(len(text))}


def encode_response(model_name, request_id, outputs, binary, classes=None):
    """(body, extra headers) of an answer: the outputs named in `binary` (True: all) as raw
    bytes after the JSON, the others inline; an output in `classes` ({name: k}) as its k best
    classes (extensions.classify)."""
    if classes:
        from .extensions import classify
        outputs = {name: classify(a, classes[name]) if name in classes else a for name, a in outputs.items()}
    sent_raw = {name: binary is True or name in binary for name in outputs}
    head = {"model_name": model_name, "model_version": "1",
            "outputs": [tensor_entry(name, a, sent_raw[name]) for name, a in outputs.items()]}
    if request_id is not None:
        head["id"] = request_id
    return encode_body(head, [a for name, a in outputs.items() if sent_raw[name]])


def decode_response(body, headers):
    """{output name: numpy array} of a response body (JSON or with binary outputs)."""
    size = headers.get(HEADER_LENGTH)
    head, tail = (body, b"") if size is None else (body[:int(size)], body[int(size):])
    response = json.loads(head)
    out, offset = {}, 0
    for entry in response["outputs"]:
        size = (entry.get("parameters") or {}).get("binary_data_size")
        if entry["datatype"] == "BYTES":
            if size is None:
                out[entry["name"]] = np.array([v.encode() for v in entry["data"]], object).reshape(entry["shape"])
                continue
            values, at = [], offset
            while at < offset + size:
                n = int.from_bytes(tail[at:at + 4], "little")
                values.append(bytes(tail[at + 4:at + 4 + n]))
                at += 4 + n
            offset += size
            out[entry["name"]] = np.array(values, object).reshape(entry["shape"])
            continue
        dtype = np.dtype(DATATYPES[entry["datatype"]])
        if size is not None:
            a = np.frombuffer(tail, dtype.newbyteorder("<"), size // dtype.itemsize, offset).astype(dtype)
            offset += size
        else:
            a = np.array(entry["data"], dtype=dtype)
        out[entry["name"]] = a.reshape(entry["shape"])
    return out
