"""The compiled module _selective (Cython, pyx/_selective.pyx): untyped from Python's side."""
from typing import Any


def __getattr__(name: str) -> Any: ...
