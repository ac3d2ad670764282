"""The ASGI application of `lamina serve` (Starlette, run by Uvicorn): the Open Inference
Protocol's routes, Prometheus metrics, and the models' batchers.

    GET  /v2/health/live              200 while the process serves
    GET  /v2/health/ready             200 once every model is loaded and batching
    GET  /v2                          server metadata (name, version, extensions)
    GET  /v2/models/{name}            the model's inputs and outputs (protocol.model_metadata)
    GET  /v2/models/{name}/ready      200 when that model serves
    POST /v2/models/{name}/infer      run a request (protocol: JSON or binary tensors; a body
                                      compressed with gzip or deflate, as Content-Encoding says)
    GET  /v2/models/{name}/config     the Triton extensions (extensions.py): configuration,
    GET  /v2/models/{name}/stats      statistics (of one model, or of all at /v2/models/stats),
    POST /v2/repository/index         and the repository's index
    GET  /metrics                     Prometheus text: requests by status, batch sizes, queue and
                                      compute time, requests queued, per model

Every route under /v2/models/{name} is served under /v2/models/{name}/versions/1 too (each model
has the one version "1"). An unknown route or method gets the protocol's JSON error body.

Every refusal is the protocol's error body, {"error": "..."}, with a 4xx status (400 bad input,
404 unknown model, 413 body or work past a limit), 503 when a model's queue is full or the server
is stopping, and 504 when a request waited past its deadline. A request whose client hangs up
while it waits leaves its model's queue at once. Bodies past DECODE_INLINE bytes are parsed and
decoded in a worker thread, so a large JSON body never holds up the event loop (health checks,
other requests).
"""
import asyncio
import contextlib
import time

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .. import __version__
from .extensions import model_config, repository_index
from .protocol import (ProtocolError, decode_inputs, model_metadata, parse_request, requested_outputs,
                       sequences_of)


DECODE_INLINE = 64 << 10  # bytes of body parsed on the event loop itself; larger ones in a thread
SECONDS_BUCKETS = (1e-4, 5e-4, 1e-3, 2e-3, 5e-3, 0.01, 0.02, 0.05, 0.1, 0.25, 1, 5)  # queue and compute times


class Metrics:
    """The server's Prometheus metrics, in a registry of its own."""

    def __init__(self):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
        self.registry = CollectorRegistry()
        self.queued = Gauge("lamina_queued_requests", "Requests waiting for a batch", ["model"],
                            registry=self.registry)
        self.requests = Counter("lamina_requests", "Inference requests answered, by model and HTTP status",
                                ["model", "status"], registry=self.registry)
        self.batch_size = Histogram("lamina_batch_size", "Requests per batch run", ["model"], registry=self.registry,
                                    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.queue_seconds = Histogram("lamina_queue_seconds", "Seconds a request waited for its batch to start",
                                       ["model"], registry=self.registry, buckets=SECONDS_BUCKETS)
        self.compute_seconds = Histogram("lamina_compute_seconds", "Seconds each batch ran", ["model"],
                                         registry=self.registry, buckets=SECONDS_BUCKETS)

    def text(self):
        from prometheus_client import generate_latest
        return generate_latest(self.registry)


def error(message, status):
    return JSONResponse({"error": message}, status_code=status)


def refusals_as_errors(handler):
    """A route whose ProtocolError is answered as the protocol's error body."""
    async def route(request):
        try:
            return await handler(request)
        except ProtocolError as e:
            return error(str(e), e.status)
    return route


class InferenceService:
    """What the HTTP and the gRPC front doors share: the models, whether the server is ready or
    stopping, its metrics, and one inference request's way through its model's batcher (a
    deadline, the client's hang-up, statistics)."""

    def __init__(self, models, timeout=10.0, metrics=None):
        self.models, self.timeout = models, timeout
        self.metrics = metrics or Metrics()
        for name, m in models.items():
            m.metrics = self.metrics
            self.metrics.queued.labels(name).set_function(lambda m=m: m.queued)
        self.ready, self.stopping = False, False

    def model(self, name, version="1"):
        """(name, ServedModel), or a 404 naming what the server has."""
        if name not in self.models:
            raise ProtocolError(f"unknown model '{name}'; this server has {', '.join(sorted(self.models))}", 404)
        if version not in ("1", ""):
            raise ProtocolError(f"model '{name}' has no version {version!r}; its one version is \"1\"", 404)
        return name, self.models[name]

    async def infer(self, name, version, decode, gone=None):
        """(body, headers) of the answer to one request: `decode(model)` (awaited) gives the
        request's (payload, arrays, outputs, binary, classes); `gone()` returns, when given, once
        the client has hung up (the request then leaves the queue). ProtocolError for a refusal,
        ClientDisconnect when the client went first."""
        started = time.perf_counter()
        metrics = self.metrics
        try:
            name, model = self.model(name, version)
            if self.stopping:
                raise ProtocolError("the server is shutting down", 503)
            payload, arrays, outputs, binary, classes = await decode(model)
            await model.prepare(arrays)
            pending = model.submit(arrays, outputs, binary or set(), payload.get("id"), classes)
            left = self.timeout - (time.perf_counter() - started)
            hang_up = asyncio.ensure_future(gone()) if gone is not None else None
            waits = (pending.future,) + ((hang_up,) if hang_up is not None else ())
            try:
                done, _ = await asyncio.wait(waits, timeout=max(left, 0.0), return_when=asyncio.FIRST_COMPLETED)
            except asyncio.CancelledError:  # the caller's task was cancelled (a gRPC client went)
                model.abandon(pending)
                raise
            finally:
                if hang_up is not None:
                    hang_up.cancel()
            if pending.future not in done:
                model.abandon(pending)
                if hang_up is not None and hang_up in done:
                    raise ClientDisconnect()
                raise ProtocolError(f"no answer within the deadline of {self.timeout:g} s (the model's queue holds "
                                    f"{model.queued} requests)", 504)
            answer = pending.future.result()
            metrics.requests.labels(name, "200").inc()
            model.stats.add("success", time.perf_counter() - started)
            return answer
        except ProtocolError as e:
            metrics.requests.labels(name if name in self.models else "-", str(e.status)).inc()
            if name in self.models:
                self.models[name].stats.add("fail", time.perf_counter() - started)
            raise
        except ClientDisconnect:
            metrics.requests.labels(name if name in self.models else "-", "499").inc()
            raise
        except asyncio.CancelledError:
            raise
        except Exception:
            metrics.requests.labels(name if name in self.models else "-", "500").inc()
            raise

    async def start(self):
        for m in self.models.values():
            m.start()
        self.ready = True

    async def stop(self):
        self.stopping = True
        await asyncio.gather(*(m.stop() for m in self.models.values()))


def build_app(models, timeout=10.0, max_body=64 * 2 ** 20, metrics=None, grpc_port=None, grpc_host="127.0.0.1",
              on_grpc=None):
    """The ASGI app over `models` ({name: ServedModel}); `timeout`: seconds a request may wait
    for its answer; `max_body`: bytes an /infer body may hold. With `grpc_port`, the protocol's
    gRPC service is served beside it (on the same batchers), from the app's start to its stop;
    on_grpc(port) is told the port it listens on."""
    service = InferenceService(models, timeout, metrics)
    metrics = service.metrics

    async def live(request):
        return JSONResponse({"live": True})

    async def ready(request):
        ok = service.ready and not service.stopping
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    async def server_metadata(request):
        return JSONResponse({"name": "lamina", "version": __version__, "extensions": EXTENSIONS,
                             "models": sorted(models)})

    def model_of(request):
        return service.model(request.path_params["name"], request.path_params.get("version", "1"))

    @refusals_as_errors
    async def config(request):
        return JSONResponse(model_config(*model_of(request)))

    @refusals_as_errors
    async def stats(request):
        chosen = [model_of(request)] if "name" in request.path_params else sorted(models.items())
        return JSONResponse({"model_stats": [model.stats.document(name) for name, model in chosen]})

    async def index(request):
        return JSONResponse(repository_index(models, service.ready and not service.stopping))

    @refusals_as_errors
    async def metadata(request):
        return JSONResponse(model_metadata(*model_of(request)))

    @refusals_as_errors
    async def model_ready(request):
        model_of(request)
        return JSONResponse({"ready": service.ready}, status_code=200 if service.ready else 503)

    async def infer(request):
        async def decode_body(model):
            body = await read_body(request, max_body)
            if len(body) > DECODE_INLINE or request.headers.get("content-encoding"):
                return await run_in_threadpool(decode, body, request.headers, model, max_body)
            return decode(body, request.headers, model)
        try:
            body, headers = await service.infer(request.path_params["name"], request.path_params.get("version", "1"),
                                                decode_body, gone=lambda: disconnected(request))
            return Response(body, headers=headers)
        except ProtocolError as e:
            return error(str(e), e.status)
        except ClientDisconnect:
            return Response(status_code=499)
        except Exception as e:  # a fault of lamina's: the request fails, the server goes on
            return error(f"internal error: {type(e).__name__}: {e}", 500)

    async def metrics_route(request):
        return Response(metrics.text(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await service.start()
        grpc_server = None
        if grpc_port is not None:
            from .grpc import start_grpc
            grpc_server, port = await start_grpc(service, grpc_host, grpc_port)
            if on_grpc is not None:
                on_grpc(port)
        yield
        await service.stop()
        if grpc_server is not None:
            await grpc_server.stop(grace=1.0)

    routes = [Route("/v2/health/live", live), Route("/v2/health/ready", ready), Route("/v2", server_metadata),
              Route("/v2/models/stats", stats), Route("/v2/repository/index", index, methods=["POST"]),
              Route("/metrics", metrics_route)]
    for base in ("/v2/models/{name}", "/v2/models/{name}/versions/{version}"):
        routes += [Route(base, metadata), Route(f"{base}/ready", model_ready), Route(f"{base}/config", config),
                   Route(f"{base}/stats", stats), Route(f"{base}/infer", infer, methods=["POST"])]

    async def http_error(request, e):  # unknown routes and methods: the protocol's error body
        what = {404: f"no route {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
        return error(what.get(e.status_code, e.detail), e.status_code)
    app = Starlette(routes=routes, lifespan=lifespan, exception_handlers={HTTPException: http_error})
    app.state.metrics = metrics
    app.state.service = service
    return app


EXTENSIONS = ["binary_tensor_data", "classification", "model_configuration", "model_repository", "statistics"]


def decode(body, headers, model, max_body=64 * 2 ** 20):
    """(request JSON, {input: array}, output names, which go binary, {output: classes asked})
    of an /infer body, inflated first where Content-Encoding says gzip or deflate."""
    body = inflate(body, headers.get("content-encoding"), max_body)
    return decode_payload(*parse_request(body, headers), model)


def decode_payload(payload, tail, model):
    """decode's answer for a parsed request (its JSON and the binary bytes after it): the
    inputs checked against the model, the outputs asked (else every one the inputs compute), a
    request of several sequences as each sequence input's list of steps. The gRPC service
    decodes through here too."""
    arrays = decode_inputs(payload, tail, model)
    outputs, binary, classes = requested_outputs(payload, model)
    padded = sequences_of(payload, arrays, model)
    if padded:  # a request of several sequences: each sequence input as a list of each one's steps
        arrays = {**arrays, **padded}
    return payload, arrays, outputs or model.default_outputs(arrays), binary, classes


def inflate(body, encoding, limit):
    """The body as sent before compression (gzip or deflate: zlib's or raw), refused with 413
    past `limit` bytes while it inflates (a small body may inflate to gigabytes)."""
    if not encoding or encoding.strip().lower() == "identity":
        return body
    kind = encoding.strip().lower()
    if kind not in ("gzip", "deflate"):
        raise ProtocolError(f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or none", 415)
    import zlib
    candidates = [zlib.MAX_WBITS | 16] if kind == "gzip" else [zlib.MAX_WBITS, -zlib.MAX_WBITS]
    for wbits in candidates:
        inflater = zlib.decompressobj(wbits)
        try:
            out = inflater.decompress(body, limit + 1)
        except zlib.error as e:
            last = e
            continue
        if len(out) > limit or inflater.unconsumed_tail:
            raise ProtocolError(f"the request body inflates past this server's limit of {limit} bytes", 413)
        if not inflater.eof:
            raise ProtocolError(f"the {kind} body is cut short")
        return out
    raise ProtocolError(f"the body is not valid {kind} data ({last})")


async def disconnected(request):
    """Returns once the client has gone (the body is read: the next message is the
    disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def read_body(request, limit):
    """The body, refused with 413 past `limit` bytes (before reading it when Content-Length says
    so, else while it streams in)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise ProtocolError(f"the request body holds {declared} bytes, more than this server's limit of {limit}", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ProtocolError(f"the request body holds more than this server's limit of {limit} bytes", 413)
        chunks.append(chunk)
    return b"".join(chunks)
