"""The Open Inference Protocol over gRPC, served beside HTTP (`lamina serve --grpc-port P`) on
the same batchers: a request becomes the JSON-and-binary form the HTTP side decodes (so both
check inputs, limits and outputs alike), and the answer comes back as raw little-endian tensor
contents. Triton's and KServe's gRPC clients speak it (service inference.GRPCInferenceService,
inference.proto beside this file; inference_pb2*.py are generated from it by `make grpc-stubs`).

A refusal is the gRPC status the HTTP status stands for: 400 INVALID_ARGUMENT, 404 NOT_FOUND,
413 RESOURCE_EXHAUSTED, 503 UNAVAILABLE, 504 DEADLINE_EXCEEDED, anything else INTERNAL. A client
that cancels its call (or lets its deadline pass) takes its request out of the queue.
"""
import numpy as np

from ... import __version__
from ..protocol import DATATYPES, ProtocolError, decode_response

# the field of InferTensorContents that carries each datatype
CONTENTS = {"BOOL": "bool_contents", "INT8": "int_contents", "INT16": "int_contents", "INT32": "int_contents",
            "INT64": "int64_contents", "UINT8": "uint_contents", "UINT16": "uint_contents",
            "UINT32": "uint_contents", "UINT64": "uint64_contents", "FP32": "fp32_contents",
            "FP64": "fp64_contents", "BYTES": "bytes_contents"}
MAX_MESSAGE = 64 << 20  # bytes of a request or answer, as --max-body-mb's default


def status_code(http_status):
    import grpc
    return {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND, 413: grpc.StatusCode.RESOURCE_EXHAUSTED,
            415: grpc.StatusCode.INVALID_ARGUMENT, 503: grpc.StatusCode.UNAVAILABLE,
            504: grpc.StatusCode.DEADLINE_EXCEEDED}.get(http_status, grpc.StatusCode.INTERNAL)


def parameter_value(p):
    """An InferParameter's value (bool, int or str)."""
    which = p.WhichOneof("parameter_choice")
    return None if which is None else getattr(p, which)


def set_parameter(target, value):
    if isinstance(value, bool):
        target.bool_param = value
    elif isinstance(value, int):
        target.int64_param = value
    else:
        target.string_param = str(value)


def as_http_request(request):
    """(payload, tail): the ModelInferRequest in the HTTP form (the JSON object, the binary
    tensor bytes after it), every input's data as binary_data_size bytes of the tail."""
    inputs, tail = [], []
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise ProtocolError(f"raw_input_contents holds {len(raw)} tensors, the request {len(request.inputs)} inputs")
    for i, tensor in enumerate(request.inputs):
        entry = {"name": tensor.name, "datatype": tensor.datatype, "shape": list(tensor.shape),
                 "parameters": {k: parameter_value(v) for k, v in tensor.parameters.items()}}
        if raw:
            data = raw[i]
        else:
            field = CONTENTS.get(tensor.datatype)
            if field is None or tensor.datatype not in DATATYPES:
                raise ProtocolError(f"input '{tensor.name}': unknown datatype {tensor.datatype!r}; expected one of "
                                    f"{', '.join(DATATYPES)}")
            data = np.asarray(getattr(tensor.contents, field), DATATYPES[tensor.datatype]).astype(
                np.dtype(DATATYPES[tensor.datatype]).newbyteorder("<")).tobytes()
        entry["parameters"]["binary_data_size"] = len(data)
        inputs.append(entry)
        tail.append(data)
    payload = {"inputs": inputs, "parameters": {k: parameter_value(v) for k, v in request.parameters.items()}}
    if request.outputs:
        payload["outputs"] = [{"name": o.name, "parameters": {k: parameter_value(v) for k, v in o.parameters.items()}}
                              for o in request.outputs]
    if request.id:
        payload["id"] = request.id
    return payload, b"".join(tail)


def decode_grpc(request, model):
    """What app.decode gives for an HTTP body: (payload, arrays, outputs, binary, classes), every
    output answered as raw bytes."""
    from ..app import decode_payload
    payload, tail = as_http_request(request)
    if not payload["inputs"]:
        raise ProtocolError("the request must hold at least one input")
    payload, arrays, outputs, _, classes = decode_payload(payload, tail, model)
    return payload, arrays, outputs, True, classes


def servicer(service, pb, base):
    """The GRPCInferenceService implementation over an app.InferenceService."""
    import grpc

    async def refuse(context, e):
        await context.abort(status_code(e.status), str(e))

    class Servicer(base):
        async def ServerLive(self, request, context):
            return pb.ServerLiveResponse(live=True)

        async def ServerReady(self, request, context):
            return pb.ServerReadyResponse(ready=service.ready and not service.stopping)

        async def ModelReady(self, request, context):
            try:
                service.model(request.name, request.version)
            except ProtocolError:
                return pb.ModelReadyResponse(ready=False)
            return pb.ModelReadyResponse(ready=service.ready and not service.stopping)

        async def ServerMetadata(self, request, context):
            # over gRPC: classification (an output's parameters); configuration, the repository
            # index and statistics are HTTP's (Triton's own gRPC calls for them are not served)
            return pb.ServerMetadataResponse(name="lamina", version=__version__, extensions=["classification"])

        async def ModelMetadata(self, request, context):
            from ..protocol import model_metadata
            try:
                name, model = service.model(request.name, request.version)
            except ProtocolError as e:
                await refuse(context, e)
            meta = model_metadata(name, model)
            tensor = pb.ModelMetadataResponse.TensorMetadata
            return pb.ModelMetadataResponse(
                name=name, versions=meta["versions"], platform=meta["platform"],
                inputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["inputs"]],
                outputs=[tensor(name=t["name"], datatype=t["datatype"], shape=t["shape"]) for t in meta["outputs"]])

        async def ModelInfer(self, request, context):
            async def decode(model):
                return decode_grpc(request, model)
            try:
                body, headers = await service.infer(request.model_name, request.model_version, decode)
            except ProtocolError as e:
                await refuse(context, e)
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # a fault of lamina's: the request fails, the server goes on
                await context.abort(grpc.StatusCode.INTERNAL, f"internal error: {type(e).__name__}: {e}")
            return as_grpc_response(pb, body, headers, request.id)

    return Servicer()


def as_grpc_response(pb, body, headers, request_id):
    from ..protocol import HEADER_LENGTH, bytes_body
    import json
    size = headers.get(HEADER_LENGTH)
    head = json.loads(bytes(body[:int(size)] if size is not None else body))
    arrays = decode_response(bytes(body), headers)
    response = pb.ModelInferResponse(model_name=head["model_name"], model_version=head["model_version"],
                                     id=request_id)
    for entry in head["outputs"]:
        a = arrays[entry["name"]]
        response.outputs.add(name=entry["name"], datatype=entry["datatype"], shape=list(a.shape))
        response.raw_output_contents.append(bytes_body(a) if a.dtype == object else
                                            np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes())
    return response


async def start_grpc(service, host, port):
    """Start the gRPC server on `host`:`port` (0: any free port) in the running event loop;
    returns (server, the port it listens on)."""
    import grpc

    from . import inference_pb2 as pb
    from . import inference_pb2_grpc as pb_grpc
    options = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]
    server = grpc.aio.server(options=options)
    pb_grpc.add_GRPCInferenceServiceServicer_to_server(servicer(service, pb, pb_grpc.GRPCInferenceServiceServicer),
                                                       server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if not bound:
        raise OSError(f"gRPC: cannot listen on {host}:{port}")
    await server.start()
    return server, bound
