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


def load_models(specs, max_batch_size=32, max_delay=0.0, max_queue=1024):
    """{name: ServedModel} from "[NAME=]PATH" strings (lamina model files or .onnx)."""
    import lamina as lm
    from .batching import ServedModel
    models = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep:
            name, path = model_name(spec), spec
        if name in models:
            raise ValueError(f"two models are named '{name}': name them, e.g. {name}2={path}")
        net = lm.onnx.load(path) if str(path).endswith(".onnx") else lm.load(path)
        models[name] = ServedModel(name, net, max_batch_size, max_delay, max_queue)
    return models


def serve(models, host="127.0.0.1", port=8000, timeout=10.0, max_body=64 * 2 ** 20, on_ready=None):
    """Serve `models` ({name: ServedModel}) until SIGTERM or Ctrl-C; requests in flight finish
    first."""
    import uvicorn
    from .app import build_app
    app = build_app(models, timeout, max_body)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on",
                            timeout_graceful_shutdown=max(timeout, 1.0) + 5)
    server = uvicorn.Server(config)
    if on_ready is not None:
        original = server.startup

        async def startup(sockets=None):
            await original(sockets)
            on_ready(server)
        server.startup = startup
    server.run()
