"""ONNX models in and out of lamina (the optional extra `lamina[onnx]`: the `onnx` package).

`load(path_or_bytes)` builds a Network whose initializers are trainable Parameters; what only
computes constants is folded at import; a model using an operator or attribute lamina lacks is
refused with one error listing every such (node, operator, attribute). `save(net, path)` writes
the network's inference graph as ONNX (opset 18). `feeds(net, arrays)` turns arrays as the ONNX
model takes them (padded sequences plus their lengths) into lamina's feeds, `to_onnx_layout` an
output into the ONNX tensor's layout."""
from .exporter import save
from .importer import UnsupportedModelError, feeds, load, to_onnx_layout

__all__ = ["load", "save", "feeds", "UnsupportedModelError", "to_onnx_layout"]
