"""What every ONNX operator converter shares, depending on nothing else of the importer: the
registry (`converter` records one function per operator and the attributes it reads; any other
attribute is refused), the Refused exception a converter raises, and the helpers that check a
converter's inputs. Converters live one module per operator family in `operators/`; the importer
looks them up here."""
import math

import numpy as np

from ... import layers as L
from ...graph import Value


class Refused(Exception):
    """Raised by a converter: this node cannot be imported (the message says why)."""


CONVERTERS: dict = {}
ATTRIBUTES: dict[str, tuple] = {}  # operator -> the attributes its converter reads (any other is refused)
# operators converted even when every input is a constant (none yet: every listed one folds)
NEVER_FOLD: frozenset[str] = frozenset()


# bytes one sample of a value an operator makes may take (its size comes from the file's
# attributes or constants: a damaged sizes input must not make the importer allocate gigabytes)
SAMPLE_LIMIT = 256 << 20
# bytes one folded node's outputs may take (the importer's constant folding, and the evaluations
# that check an attention or fold position ids)
FOLD_LIMIT = 256 << 20


def bounded_sample(shape, what):
    """shape, or Refused where one float32 sample of it would pass SAMPLE_LIMIT bytes."""
    count = math.prod(int(n) for n in shape)
    if count * 4 > SAMPLE_LIMIT:
        raise Refused(f"{what} of shape {list(shape)} per sample: {count * 4:,} bytes, more than the "
                      f"{SAMPLE_LIMIT:,} lamina allows one sample an operator makes")
    return shape


def default_axes(spec):
    """The ONNX axes of a lamina value in the usual layout: batch (and time) first."""
    return ("N",) + (("T",) if spec.sequence else ()) + tuple(range(len(spec.shape)))


def onnx_shape(imp, v):
    """The ONNX shape of a lamina value, its batch and time axes by name."""
    axes = imp.axes_of(v)
    return [a if isinstance(a, str) else v.spec.shape[a] for a in axes]


def converter(*op_types, attributes=()):
    def register(fn):
        for op in op_types:
            CONVERTERS[op] = fn
            ATTRIBUTES[op] = frozenset(attributes)
        return fn
    return register


def unsupported_attributes(op_type, attrs):
    """The attributes of a node that lamina's converter does not read, as a refusal reason."""
    extra = sorted(set(attrs) - ATTRIBUTES.get(op_type, frozenset()))
    return f"attribute{'s' if len(extra) > 1 else ''} {', '.join(extra)} not supported" if extra else None


def value(x, what, kind="float", imp=None):
    """An input that is a lamina value of `kind` ('float': lamina's layers compute on floats),
    in the usual layout (batch, and time, first) unless the converter handles others itself."""
    if not isinstance(x, Value):
        raise Refused(f"{what} must depend on the model's inputs (a constant here)")
    if x.spec.kind != kind:
        raise Refused(f"{what} holds {x.spec.kind} values; this operator computes on {kind} in lamina")
    axes = getattr(x, "onnx_axes", None)
    if axes is not None and axes != default_axes(x.spec):
        raise Refused(f"{what} has its axes as {axes} (N batch, T time, k lamina's axis k); this operator "
                      f"takes the batch axis first")
    return x


def onnx_shape_text(imp, x):
    """A value's ONNX shape for a message: [N, 3, 4], the batch and time axes by name."""
    return f"[{', '.join(map(str, onnx_shape(imp, x)))}]" + (" (a sequence)" if x.spec.sequence else "")


def const(x, what):
    if not isinstance(x, np.ndarray):
        raise Refused(f"{what} must be a constant (an initializer); lamina takes it as a parameter")
    if x.dtype.kind not in "biuf":
        raise Refused(f"{what} is a tensor of {x.dtype} (strings?); lamina takes numbers")
    return x


def text(attrs, name, default):
    """A string attribute (the onnx package gives them as bytes)."""
    v = attrs.get(name, default)
    return v.decode() if isinstance(v, bytes) else v


def assign(layer, name, values):
    p = layer.params[name]
    values = np.asarray(values)
    if values.dtype.kind not in "biuf":
        raise Refused(f"{name} is a tensor of {values.dtype} (strings?); lamina's parameters are numbers")
    values = values.astype(np.float32)
    if values.shape != p.shape:
        raise Refused(f"{name} has shape {values.shape}, the layer expects {p.shape}")
    if not np.all(np.isfinite(values)):
        raise Refused(f"{name} holds NaN or infinity (as float32: {np.count_nonzero(~np.isfinite(values))} of "
                      f"{values.size} values)")
    p.assign(values)


def bias_of(c, shape, negate):
    """A constant broadcast over one sample's shape, or None where it varies along the batch."""
    if c.ndim > len(shape) + 1 or (c.ndim == len(shape) + 1 and c.shape[0] != 1):
        return None
    try:
        full = np.broadcast_to(c.reshape(c.shape[1:] if c.ndim == len(shape) + 1 else c.shape), shape)
    except ValueError:
        return None
    return -full if negate else full


def fixed_bias(shape, values):
    """A Bias layer adding `values` (a scalar, or one value per position of a sample), frozen: a
    fixed part of an operator (a clip's shift, a pad's fill value, a zero point), not a parameter
    to train."""
    layer = L.Bias(shape)
    bias = layer.params["bias"]
    values = np.asarray(values, np.float32)
    bias.assign(values.reshape(bias.shape) if values.size == bias.size else np.broadcast_to(values, bias.shape).copy())
    bias.frozen = True
    return layer
