"""The compiled module _kernels (Cython, pyx/_kernels.pyx): untyped from Python's side."""
from typing import Any


def __getattr__(name: str) -> Any: ...
