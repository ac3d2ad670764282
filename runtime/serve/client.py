"""A small client of the Open Inference Protocol over httpx: numpy arrays in, numpy arrays out,
binary tensors both ways by default (JSON with binary=False)."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence

import numpy as np

from ..errors import ServerError
from ..sequence import Sequences
from .protocol import decode_response, encode_body, tensor_entry


class Client:
    """client = Client("http://127.0.0.1:8000"); client.infer(model, {name: array}) -> {name: array}.
    A sequence input is one sequence's steps (an array, or a Sequences of one), or a
    lamina.Sequences of several sequences (sent padded, with their lengths); the answer's
    sequence outputs then come padded, [n, T, ...], zeros past each sequence's end."""

    def __init__(self, url: str = "http://127.0.0.1:8000", timeout: float = 60.0, http: Any = None) -> None:
        """`http`: an httpx.Client to send through instead (a Starlette TestClient of the app,
        say); `url` and `timeout` are then its own."""
        import httpx
        self.url = url.rstrip("/") if http is None else str(http.base_url)
        self.http = http if http is not None else httpx.Client(base_url=self.url, timeout=timeout)

    def close(self) -> None:
        self.http.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _get(self, path):
        r = self.http.get(path)
        if r.status_code != 200:
            raise ServerError(r.status_code, _message(r))
        return r.json()

    def live(self) -> bool:
        return self.http.get("/v2/health/live").status_code == 200

    def ready(self) -> bool:
        return self.http.get("/v2/health/ready").status_code == 200

    def metadata(self, model: str) -> dict[str, Any]:
        return self._get(f"/v2/models/{model}")

    def infer(self, model: str, inputs: Mapping[str, Any], outputs: Optional[Sequence[str]] = None, binary: bool = True,
              request_id: Optional[str] = None) -> dict[str, np.ndarray]:
        body, headers = encode_request(inputs, outputs, binary, request_id)
        r = self.http.post(f"/v2/models/{model}/infer", content=body, headers=headers)
        if r.status_code != 200:
            raise ServerError(r.status_code, _message(r))
        return decode_response(r.content, r.headers)


def encode_request(inputs: Mapping[str, Any], outputs: Optional[Sequence[str]] = None, binary: bool = True,
                   request_id: Optional[str] = None) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of an /infer request."""
    arrays, lengths = {}, None
    for name, a in inputs.items():
        if isinstance(a, Sequences) and a.num_sequences == 1:
            a = a.values
        elif isinstance(a, Sequences):
            if lengths is not None and not np.array_equal(a.lengths, lengths):
                raise ValueError(f"input '{name}': its sequences' lengths differ from the other sequence input's")
            lengths = a.lengths
            a = a.to_padded()[0]
        arrays[name] = np.asarray(a)
    request: dict[str, Any] = {"inputs": [tensor_entry(name, a, binary) for name, a in arrays.items()]}
    if lengths is not None:
        request["parameters"] = {"sequence_lengths": [int(n) for n in lengths]}
    if outputs is not None:
        request["outputs"] = [{"name": o} for o in outputs]
    if binary:
        request["parameters"] = {**request.get("parameters", {}), "binary_data_output": True}
    if request_id is not None:
        request["id"] = request_id
    body, headers = encode_body(request, list(arrays.values()) if binary else [])
    return bytes(body), headers  # httpx sends bytes (it would iterate a memoryview)


def _message(response):
    try:
        return response.json().get("error", response.text)
    except ValueError:
        return response.text
