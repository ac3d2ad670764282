"""`lamina serve`: an inference server speaking the Open Inference Protocol (KServe v2) over
HTTP, with dynamic batching of concurrent requests (sequences packed without padding), on
Starlette and Uvicorn (the optional extra `lamina[serve]`). `Client` talks to it.

    from lamina.serve import Client
    client = Client("http://127.0.0.1:8000")
    out = client.infer("python_lm", {"ids": ids, "h0": h0, "c0": c0}, outputs=["last"])
"""
from .client import Client, ServerError

__all__ = ["Client", "ServerError", "serve", "load_models", "model_name"]


def model_name(path):
    """A model's name from its file: the stem, or the folder's name for .../model.lamina."""
    from pathlib import Path
    p = Path(path)
    return p.parent.name if p.name == "model.lamina" and p.parent.name else p.stem


def load_models(specs, max_batch_size=32, max_delay=0.0, max_queue=1024, limits=None, max_batch_bytes=512 << 20):
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


def serve(models, host="127.0.0.1", port=8000, timeout=10.0, max_body=64 * 2 ** 20, on_ready=None,
          max_connections=1000, request_timeout=30.0, keep_alive=5.0):
    """Serve `models` ({name: ServedModel}) until SIGTERM or Ctrl-C; requests in flight finish
    first, then the process exits normally. At most `max_connections` connections are served at
    once (503 past that); each must deliver a whole request within `request_timeout` seconds of
    its start, and an idle keep-alive connection is closed after `keep_alive` seconds."""
    from ..extras import require
    uvicorn = require("uvicorn", "serve")
    require("starlette", "serve")
    require("httptools", "serve")
    from .app import build_app
    from .connections import GracefulServer, deadline_protocol
    app = build_app(models, timeout, max_body)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=max(timeout, 1.0) + 5, http=deadline_protocol(request_timeout),
                            limit_concurrency=max_connections, timeout_keep_alive=keep_alive)
    server = GracefulServer(config)
    if on_ready is not None:
        original = server.startup

        async def startup(sockets=None):
            await original(sockets)
            on_ready(server)
        server.startup = startup
    server.run()
