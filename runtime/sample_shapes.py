"""Inputs whose sample shape a batch sets (images of any height and width).

A network fixes every value's shape when it is validated, and its buffers, algorithm choices and
folded shape arithmetic follow from those shapes. A network with dynamic sample axes
(`Network.dynamic_axes`: input name -> {sample axis: its symbol}) is therefore run at each sample
shape by a network made for that shape: `Specializations.get` builds one the first time a shape
is fed, by the network's own `make` (the ONNX importer imports the model again at those shapes,
so shape arithmetic folds at the real sizes), and keeps the most recent few. Every such network
uses the base network's Parameter objects (so training at any shape trains the one set of
weights, and an optimizer made over `base.parameters()` updates them), its lock (so a training
step at one shape and a run at another never overlap), backend, precision and generator.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any, Callable, Mapping, Optional

import numpy as np

from .errors import GraphError, InputError
from .sequence import Sequences

# networks kept per base network, most recently used last: each holds buffers sized for its shape
KEPT = 8


def fed_sample_shape(a: Any) -> Optional[tuple]:
    """The per-row shape of a fed array or Sequences batch; None for anything else (whose
    errors the scheduler reports)."""
    if isinstance(a, Sequences):
        a = a.values
    if isinstance(a, np.ndarray) and a.ndim >= 1:
        return tuple(a.shape[1:])
    return None


class Specializations:
    """The networks made from one base network for the sample shapes batches have had.

    `make` builds the first `inputs` inputs and `nodes` nodes of the base network at given sample
    shapes (the ONNX importer's import); None where the base network was built in Python. The
    rest of the base network (all of it without `make`: the layers a caller added, a loss on an
    imported model) is then added to the made network as it is, the same layer objects at the new
    shapes."""

    def __init__(self, make: Optional[Callable[[dict], Any]] = None, inputs: int = 0, nodes: int = 0) -> None:
        self.make, self.inputs, self.nodes = make, inputs, nodes
        self.kept: OrderedDict = OrderedDict()
        self.lock = threading.Lock()

    def clear(self) -> None:
        with self.lock:
            self.kept.clear()

    def declared(self, base: Any) -> dict:
        """The dynamic axes declared on inputs the caller built (those a model file keeps): an
        imported model's own are the importer's, valid only where it imports again."""
        own = set(base.input_names[:self.inputs]) if self.make is not None else set()
        return {name: axes for name, axes in base.dynamic_axes.items() if name not in own}

    def shapes_for(self, base: Any, feeds: Mapping[str, Any]) -> Optional[dict]:
        """The sample shapes `feeds` give the base network's dynamic inputs, when they differ
        from the base's own on dynamic axes alone; None where the base network runs them itself
        (same shapes, or a difference on a fixed axis, which the base's checks report). A dynamic
        input not fed has no shape here: what reads it is left out of the made network."""
        shapes, differ = {}, False
        for name, axes in base.dynamic_axes.items():
            if name not in feeds:
                continue
            own = base.values[name].spec.shape
            fed = fed_sample_shape(feeds[name])
            if fed is None or len(fed) != len(own) or any(f != o for i, (f, o) in enumerate(zip(fed, own))
                                                          if i not in axes):
                return None
            if any(f < 1 for f in fed):
                raise InputError(f"input '{name}': every sample axis must be at least 1, found {fed}")
            differ |= fed != own
            shapes[name] = fed
        return shapes if differ else None

    def get(self, base: Any, shapes: dict) -> Any:
        key = tuple(sorted(shapes.items()))
        with self.lock:
            net = self.kept.get(key)
            if net is not None:
                self.kept.move_to_end(key)
                return net
            net = self.build(base, shapes)
            self.kept[key] = net
            while len(self.kept) > KEPT:
                self.kept.popitem(last=False)
            return net

    def build(self, base: Any, shapes: dict) -> Any:
        from .graph import Network
        made_inputs = base.input_names[:self.inputs]
        if self.make is not None:
            net = self.make({k: shapes.get(k, base.values[k].spec.shape) for k in made_inputs if k in base.dynamic_axes})
        else:
            net = Network(dtype=base.dtype, backend=base.backend)
        where = ", ".join(f"'{k}' {tuple(v)}" for k, v in shapes.items())
        # dynamic inputs this batch does not feed, and every value computed from them: left out
        missing = {n for n in base.input_names[self.inputs:] if n in base.dynamic_axes and n not in shapes}
        reads = {n: n for n in missing}  # a value left out -> the input it is computed from
        try:
            for name in base.input_names[self.inputs:]:
                if name not in missing:
                    spec = base.values[name].spec
                    net.input(name, shapes.get(name, spec.shape), spec.kind, spec.sequence)
                    net.values[name].requires_grad = base.values[name].requires_grad
            made_nodes = {node.name for node in base.nodes[:self.nodes]}
            for node in base.validate():
                if node.name in made_nodes:
                    continue
                lost = [reads[n] for n in node.input_names if n in reads]
                if lost:
                    reads.update(dict.fromkeys(node.outputs, lost[0]))
                else:
                    net.add(node.layer, list(node.input_names), name=node.name)
            net.outputs(**{o: v for o, v in base.output_values.items() if v not in reads})
            net.left_out = {o: reads[v] for o, v in base.output_values.items() if v in reads}
            net.validate()
        except GraphError as e:
            raise InputError(f"sample shapes {where}: {e}") from None
        share_state(base, net, shapes)
        return net


def check_outputs(net: Any, outputs: Any, base: Any) -> None:
    """Refuse outputs of the base network that the made network left out (computed from an
    input the batch does not feed), as the base network refuses a missing input."""
    wanted = [outputs] if isinstance(outputs, str) else list(outputs or base.output_values)
    for o in wanted:
        if o in getattr(net, "left_out", {}):
            raise InputError(f"missing input {net.left_out[o]!r} (needed for output {o!r})")


def share_state(base: Any, net: Any, shapes: dict) -> None:
    """Make `net` (built for `shapes`) use the base network's parameters and state."""
    where = ", ".join(f"'{k}' {tuple(v)}" for k, v in shapes.items())
    own = dict(base.named_parameters())
    made = dict(net.named_parameters())
    if set(own) != set(made):
        extra = sorted(set(own) ^ set(made))
        raise GraphError(f"the network made for sample shapes {where} does not have the base network's "
                         f"parameters (differing: {', '.join(extra[:5])})")
    for layer in net.layers:
        for local, p in list(layer.params.items()):
            shared = own[p.name]
            if shared.shape != p.shape:
                raise GraphError(f"the network made for sample shapes {where}: parameter '{p.name}' has shape "
                                 f"{p.shape}, the base network's {shared.shape}")
            layer.params[local] = shared
    for attr in ("dtype", "precision", "training_precision", "backend", "rng", "assets", "_lock"):
        setattr(net, attr, getattr(base, attr))
    for attr in ("onnx_axes", "onnx_lengths", "onnx_constant_lengths", "onnx_masks", "onnx_reserved_ids"):
        if hasattr(base, attr):
            setattr(net, attr, getattr(base, attr))
    net.dynamic_axes = {}  # runs at its own shapes only; the base picks the network per batch
    net._invalidate()
