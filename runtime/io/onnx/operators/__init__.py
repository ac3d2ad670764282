"""The converters of ONNX's operators, one module per family; importing this package registers
them all (lamina.io.onnx.registry)."""
from . import activations, arithmetic, conditions, dense, layout, losses, normalization, recurrent, sorting, volumes  # noqa: F401
