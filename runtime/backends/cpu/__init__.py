"""The CPU backend (backend.py) and its algorithms: conv_algorithms.py (the convolutions), fused_recurrence.py."""
from .backend import CPUBackend, PackedMatrix

__all__ = ["CPUBackend", "PackedMatrix"]
