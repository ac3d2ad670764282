"""`lamina serve`: an inference server speaking the Open Inference Protocol (KServe v2) over
HTTP, with dynamic batching of concurrent requests (sequences packed without padding), on
Starlette and Uvicorn (the optional extra `lamina[serve]`). `Client` talks to it.

    from lamina.serve import Client
    client = Client("http://127.0.0.1:8000")
    out = client.infer("python_lm", {"ids": ids, "h0": h0, "c0": c0}, outputs=["last"])
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional, Sequence

from ..types import PathLike

from .client import Client, ServerError

__all__ = ["Client", "ServerError", "serve", "load_models", "model_name"]


def model_name(path: PathLike) -> str:
    """A model's name from its file: the stem, or the folder's name for .../model.lamina."""
    from pathlib import Path
    p = Path(path)
    return p.parent.name if p.name == "model.lamina" and p.parent.name else p.stem


def load_models(specs: Sequence[str], max_batch_size: int = 32, max_delay: float = 0.0, max_queue: int = 1024,
                limits: Any = None, max_batch_bytes: int = 512 << 20) -> dict[str, Any]:
    """{name: ServedModel} from "[NAME=]PATH" strings (lamina model files or .onnx); `limits`
    (protocol.Limits) bound each request's work, `max_batch_bytes` each batch's buffers."""
    import lamina as lm
    from ..extras import require
    require("starlette", "serve")
    require("prometheus_client", "serve")
    from .batching import ServedModel
    models = {}
    for spec in specs:
        from ..models import resolve
        name, sep, path = spec.partition("=")
        path = resolve(path if sep else spec)
        if not sep:
            name = model_name(path)
        if name in models:
            raise ValueError(f"two models are named '{name}': name them, e.g. {name}2={path}")
        net = lm.onnx.load(path) if str(path).endswith(".onnx") else lm.load(path)
        models[name] = ServedModel(name, net, max_batch_size, max_delay, max_queue, limits=limits,
                                   max_batch_bytes=max_batch_bytes)
    return models


def serve(models: Mapping[str, Any], host: str = "127.0.0.1", port: int = 8000, timeout: float = 10.0,
          max_body: int = 64 * 2 ** 20, on_ready: Optional[Callable[[Any], None]] = None, max_connections: int = 1000,
          request_timeout: float = 30.0, keep_alive: float = 5.0, grpc_port: Optional[int] = None) -> None:
    """Serve `models` ({name: ServedModel}) until SIGTERM or Ctrl-C; requests in flight finish
    first, then the process exits normally. At most `max_connections` connections are served at
    once (503 past that); each must deliver a whole request within `request_timeout` seconds of
    its start, and an idle keep-alive connection is closed after `keep_alive` seconds. With
    `grpc_port` (0: any free port), the protocol's gRPC service listens there too (the extra
    `grpc`); `server.grpc_port` is the port it took."""
    from ..extras import require
    uvicorn = require("uvicorn", "serve")
    require("starlette", "serve")
    require("httptools", "serve")
    from .app import build_app
    from .connections import GracefulServer, deadline_protocol
    if grpc_port is not None:
        require("grpc", "grpc")
    bound: dict[str, int] = {}
    app = build_app(models, timeout, max_body, grpc_port=grpc_port, grpc_host=host,
                    on_grpc=lambda port: bound.update(port=port))
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=max(timeout, 1.0) + 5, http=deadline_protocol(request_timeout),
                            limit_concurrency=max_connections, timeout_keep_alive=keep_alive)
    server = GracefulServer(config)
    server.grpc_port = None
    if on_ready is not None:
        original = server.startup

        async def startup(sockets=None):
            await original(sockets)
            server.grpc_port = bound.get("port")
            on_ready(server)
        server.startup = startup  # type: ignore[method-assign]
    server.run()
