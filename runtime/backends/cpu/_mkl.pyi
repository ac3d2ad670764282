"""The compiled module _mkl (Cython, pyx/_mkl.pyx): untyped from Python's side."""
from typing import Any


def __getattr__(name: str) -> Any: ...
