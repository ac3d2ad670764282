"""The compiled module _openblas (Cython, pyx/_openblas.pyx): untyped from Python's side."""
from typing import Any


def __getattr__(name: str) -> Any: ...
