"""The CPU backend (backend.py) and its algorithms: convolution.py, recurrence.py."""
from .backend import CPUBackend, PackedMatrix

__all__ = ["CPUBackend", "PackedMatrix"]
