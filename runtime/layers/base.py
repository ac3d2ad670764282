"""The layer protocol. A layer is written once for every backend: it calls only the kernel
interface (ctx.be) and keeps forward and backward side by side.

forward(ctx):  read ctx.inputs, write ctx.output (preallocated).
backward(ctx): read ctx.grad_output; for each input slot, ctx.input_grad(slot) is a target
               (array, beta) or None; for each parameter, ctx.param_grad(name) likewise.
               Write every target "with beta" (out = new + beta * out).
"""
from __future__ import annotations

import contextvars
from contextlib import contextmanager
from typing import Optional

import numpy as np

from ..errors import InputError
from ..graph import Spec, Value
from ..packing import PackedWeight
from ..parameter import Parameter
from ..types import Shape

REGISTRY: dict[str, type] = {}

# While a model file is read, parameters are not initialised: their configured shapes are checked
# against the file's tensors first (a config claiming 2e7 channels must not allocate gigabytes
# before it is refused), and their values come from the file.
_FROM_FILE = contextvars.ContextVar("lamina_parameters_from_file", default=None)


class Init:
    """A parameter's initial values, made only when they are needed: `make(shape)`."""

    def __init__(self, shape, make):
        self.shape, self.make = tuple(int(s) for s in shape), make


@contextmanager
def parameters_from_file(shape_of):
    """Within: a layer's parameters get uninitialised storage of the shape the file declares.
    shape_of(layer, local, shape) returns that shape after checking `shape` against it (it
    raises when they differ); no initial values are drawn."""
    token = _FROM_FILE.set(shape_of)
    try:
        yield
    finally:
        _FROM_FILE.reset(token)


def register(cls):
    """Make a layer type known by its `kind` (model files name layers this way)."""
    if cls.kind in REGISTRY:
        raise ValueError(f"layer kind {cls.kind!r} is registered twice")
    REGISTRY[cls.kind] = cls
    return cls


class Layer:
    kind = "layer"
    is_cost = False
    arity = (1, 1)  # (fewest, most) inputs
    output_labels: tuple[str, ...] = ("",)  # one per output; "" is the node's own name, others '<node>.<label>'
    # a layer written against the backend interface alone runs on every backend; one that calls
    # numpy on its arrays runs only where they are numpy arrays (Backend.host_arrays)
    needs_host_arrays = False
    # input slots that take an initial state, zeros when a caller has none (recurrent layers'
    # h0 and c0, as PyTorch's): a server lets requests leave such inputs out
    initial_state_slots: tuple[int, ...] = ()

    def __init__(self, name: Optional[str] = None) -> None:
        self.name = name
        self.params: dict[str, Parameter] = {}
        self._packs: dict = {}  # (id(param), transposed, precision, method) -> PackedWeight (packed_weight)

    def __repr__(self):
        return f"{type(self).__name__}({self.name!r})"

    def __call__(self, *inputs):
        for v in inputs:
            if isinstance(v, Value):
                return v.network.add(self, inputs)
        raise TypeError(f"{type(self).__name__}: call it on Values from a Network (net.input(...) "
                        f"or another layer's output); found {[type(v).__name__ for v in inputs]}")

    # ---- parameters
    def add_param(self, name, value, **kw):
        """A parameter from its initial values: an array, or an Init (drawn only when needed)."""
        shape_of = _FROM_FILE.get()
        if isinstance(value, Init):
            if shape_of is not None:
                value = np.empty(shape_of(self, name, value.shape), np.float32)
            else:
                value = value.make(value.shape)
        p = Parameter(value, **kw)
        self.params[name] = p
        return p

    def product_weights(self) -> tuple[str, ...]:
        """The parameters (local names) this layer holds in the network's precision
        (lamina.precision): the weights it multiplies by (their packs are made in that precision)
        or looks rows up in; Network.set_precision rounds them to it, and a model file stores
        them in it."""
        return ()

    def packed_weight(self, be, param, transpose, rows, precision="float32", method="pack"):
        """op(param) packed for backend `be` (Backend.pack, or the backend's `method` of the same
        arguments) and products in `precision`, for products of up to `rows` rows, rebuilt
        whenever the parameter's values or the backend change (lamina.packing)."""
        key = (id(param), transpose, precision, method)
        pack = self._packs.get(key)
        if pack is None or pack.param is not param:
            pack = self._packs[key] = PackedWeight(param, trans=transpose, precision=precision, method=method)
        return pack.get(be, rows)

    def bind_parameters(self):
        for pname, p in self.params.items():
            if p.name is None:
                p.name = f"{self.name}.{pname}"

    def tie(self, name, param):
        """Use another layer's parameter as this layer's `name` (shared weights)."""
        mine = self.params[name]
        if mine.shape != param.shape:
            raise ValueError(f"{self}: cannot tie {name} of shape {mine.shape} to {param.name} of shape {param.shape}")
        self.params[name] = param

    # ---- graph-time checks
    def check_inputs(self, specs):
        lo, hi = self.arity
        if not lo <= len(specs) <= hi:
            expected = str(lo) if lo == hi else f"{lo} to {hi}"
            raise ValueError(f"expected {expected} inputs, found {len(specs)}")
        return self.output_spec(specs)

    def output_spec(self, specs):
        """The output's Spec (a tuple of Specs for several outputs); raise ValueError saying
        what is wrong."""
        raise NotImplementedError

    # ---- inference fusion (the scheduler's, see lamina.scheduler)
    def as_activation(self):
        """(kind, slope) when this layer is an element-wise activation of its one input and
        nothing more, else None."""
        return None

    def fuses_activation(self, kind):
        """Whether forward applies the element-wise activation `kind` to its own output when
        ctx.activation asks (then a following activation layer runs inside this one)."""
        return False

    def as_max_pool(self):
        """The window (kernel, stride, padding: 3-tuples, as Backend.max_pool takes) when this layer
        is a max pool of its one input and nothing more, else None."""
        return None

    def fuses_max_pool(self):
        """Whether forward writes a max pool of its own output when ctx.pool asks (then a following
        max pool runs inside this one)."""
        return False

    def is_view(self):
        """Whether the output is the one input's values, in order, in another shape (at inference
        it can be the input's own buffer, and the layer need not run)."""
        return False

    def grad_slots(self, n_inputs):
        """Input slots whose gradient backward computes (costs leave labels and weights out)."""
        return range(n_inputs)

    def config(self):
        """JSON-able constructor arguments (model files)."""
        return {}

    # ---- running
    def forward(self, ctx):
        raise NotImplementedError

    def backward(self, ctx):
        raise NotImplementedError


def check_ids(ctx, ids, bound, what):
    """Raise an InputError naming the layer unless every id lies in [0, bound)."""
    if len(ids) and (ids.min() < 0 or ids.max() >= bound):
        at = int(np.flatnonzero((ids < 0) | (ids >= bound))[0])
        raise InputError(f"{ctx.node.describe()}: {what} must lie in [0, {bound}), found {ids[at]} at row {at}")


def require_float(spec, what):
    if spec.kind != "float":
        raise ValueError(f"{what} must be float, found {spec}")


def require_features(spec, what):
    """A float input with one axis of features per sample; returns the feature count."""
    require_float(spec, what)
    if len(spec.shape) != 1:
        raise ValueError(f"{what} must have shape [features] per sample, found {spec}")
    return spec.shape[0]


def require_volume(spec, nd, what="input 0"):
    """A float per-sample [C, D, H, W] (nd = 3) or [C, H, W] (nd = 2)."""
    require_float(spec, what)
    if spec.sequence or len(spec.shape) != nd + 1:
        axes = "C, D, H, W" if nd == 3 else "C, H, W"
        raise ValueError(f"{what} must be [{axes}] per sample, found {spec}")
    return spec


def int_tuple(value, nd, what):
    """An int or nd ints (PyTorch's kernel_size/stride/padding convention) as an nd-tuple."""
    t = tuple(int(v) for v in value) if isinstance(value, (tuple, list)) else (int(value),) * nd
    if len(t) != nd:
        raise ValueError(f"{what} must be an int or {nd} ints, found {value!r}")
    return t


def padding_pairs(value, nd, what):
    """(before, after) per axis from an int, nd ints (both sides alike) or nd (before, after)
    pairs (ONNX's asymmetric pads, TensorFlow's SAME padding)."""
    if isinstance(value, (tuple, list)) and value and all(isinstance(v, (tuple, list)) for v in value):
        pairs = tuple((int(a), int(b)) for a, b in value) if all(len(v) == 2 for v in value) else ()
        if len(pairs) != nd:
            raise ValueError(f"{what} must be an int, {nd} ints or {nd} (before, after) pairs, found {value!r}")
        return tuple(a for a, _ in pairs), tuple(b for _, b in pairs)
    both = int_tuple(value, nd, what)
    return both, both


def uniform(rng, bound, shape):
    """U(-bound, bound) initial values (drawn from rng when the parameter is made)."""
    return Init(shape, lambda s: rng.uniform(-bound, bound, size=s).astype(np.float32))


def constant(value, shape):
    return Init(shape, lambda s: np.full(s, value, np.float32))


def same_specs(specs, what):
    first = specs[0]
    require_float(first, f"{what} input 0")
    for i, s in enumerate(specs[1:], 1):
        if s != first:
            raise ValueError(f"{what} input {i} is {s}, expected {first} like input 0")
    return Spec(first.shape, sequence=first.sequence)


def common_rows(specs, what="inputs"):
    """Whether the inputs are sequence batches; they must agree."""
    flags = {s.sequence for s in specs}
    if len(flags) > 1:
        raise ValueError(f"{what} mix sequence batches and per-sample rows: {specs}")
    return flags.pop()
