"""Dense layers: fully connected, element-wise sum and product, concatenation, activations
(PReLU too), dropout, scale, bias."""
from __future__ import annotations

import math
from typing import Optional, Sequence, Union

from ..backends.base import ACTIVATIONS, INPUT_GRAD_ACTIVATIONS, check_activation
from ..graph import Spec
from ..random import generator
from .base import Layer, common_rows, constant, register, require_features, require_float, same_specs, uniform
from ..types import Shape


class _Activated(Layer):
    """A layer whose output is act(z): forward applies act in place on the output; backward
    turns the output gradient into dL/dz (in a workspace unless act is linear)."""

    fused = True  # act is applied in place on the output: its derivative must follow from y

    def __init__(self, activation: str, slope: float, name: Optional[str]) -> None:
        super().__init__(name)
        self.activation = check_activation(activation or "linear", type(self).__name__)
        if self.fused and self.activation in INPUT_GRAD_ACTIVATIONS:
            raise ValueError(f"{type(self).__name__}: activation {self.activation!r} needs its input in backward; "
                             f"apply it as a separate Activation layer")
        self.slope = float(slope)

    def _activate(self, ctx):
        kind, slope = ctx.activation or (self.activation, self.slope)
        if kind != "linear":
            ctx.be.activation(kind, ctx.output, ctx.output, slope)

    def fuses_activation(self, kind):
        return self.fused and self.activation == "linear" and kind in ACTIVATIONS

    def _grad_pre_activation(self, ctx):
        dy = ctx.grad_output
        if self.activation == "linear":
            return dy
        dz = ctx.workspace("dz", dy.shape)
        ctx.be.activation_backward(self.activation, ctx.output, dy, dz, 0.0, self.slope)
        return dz

    def _act_config(self):
        return {"activation": self.activation, "slope": self.slope}


def affine(layer, ctx, x, wname, y, bname=None, beta=0.0):
    """y = x Wᵀ + b + beta y for the layer's parameters W [out, in] and b [out] (bname None: no b).
    From W's pack where the run multiplies in another precision (made again after each update, in
    training), or at inference where the backend computes faster from it
    (Backend.packs_fixed_weights)."""
    be, w = ctx.be, layer.params[wname]
    bias = layer.params[bname].buffer if bname else None
    pack_rows = 0 if ctx.training or ctx.precision != "float32" else be.packs_fixed_weights(x.shape[0],
                                                                                          *reversed(w.shape))
    if ctx.precision != "float32" or pack_rows:
        packed = layer.packed_weight(be, w, True, max(x.shape[0], pack_rows), ctx.precision)
        if bias is not None:
            be.packed_gemm_bias(x, packed, y, bias)
        else:
            be.packed_gemm(x, packed, y, beta=beta)
    elif bias is not None:
        be.gemm_bias(x, w.buffer, y, bias, trans_b=True)
    else:
        be.gemm(x, w.buffer, y, trans_b=True, beta=beta)


def affine_backward(layer, ctx, dz, x, wname, bname, dx):
    """The gradients of affine for dz = dL/dy: dx = dz W (a GradTarget or None), dW = dzᵀ x and
    db = Σ_rows dz into the parameters' targets, in the run's product precision (float32, or
    bfloat16 under Network.autocast)."""
    be, precision = ctx.be, ctx.precision
    if dx is not None:
        be.gemm_in(precision, dz, layer.params[wname].buffer, dx.array, beta=dx.beta)
    dw = ctx.param_grad(wname)
    if dw is not None:
        be.gemm_in(precision, dz, x, dw.array, trans_a=True, beta=dw.beta)
    db = ctx.param_grad(bname) if bname else None
    if db is not None:
        be.bias_grad(dz, db.array, db.beta)


@register
class Linear(_Activated):
    """y = act(sum_i x_i W_iᵀ + b); x_i [N, in_i], W_i [out, in_i] (torch.nn.Linear's layout),
    b [out]. Several inputs (in_features a list) each get their own weight: weight_0, weight_1…"""

    kind = "linear"

    def __init__(self, in_features: Union[int, Sequence[int]], out_features: int, bias: bool = True,
                 activation: str = "linear", slope: float = 0.01, name: Optional[str] = None) -> None:
        super().__init__(activation, slope, name)
        multi = isinstance(in_features, (list, tuple))
        self.in_features = [int(i) for i in in_features] if isinstance(in_features, (list, tuple)) else \
            [int(in_features)]  # type: ignore[arg-type]
        self.out_features = int(out_features)
        self.multi, self.has_bias = multi, bool(bias)
        if min(self.in_features) < 1 or self.out_features < 1:
            raise ValueError(f"Linear: sizes must be at least 1, found in={in_features}, out={out_features}")
        self.arity = (len(self.in_features),) * 2
        # PyTorch's default: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weights and bias
        bound = 1 / math.sqrt(sum(self.in_features))
        rng = generator()
        self.weight_names = [f"weight_{i}" if multi else "weight" for i in range(len(self.in_features))]
        for wname, n_in in zip(self.weight_names, self.in_features):
            self.add_param(wname, uniform(rng, bound, (self.out_features, n_in)))
        if self.has_bias:
            self.add_param("bias", uniform(rng, bound, (self.out_features,)))

    @property
    def weight(self):
        return self.params[self.weight_names[0]]

    @property
    def bias(self):
        return self.params.get("bias")

    def output_spec(self, specs):
        for i, (spec, n_in) in enumerate(zip(specs, self.in_features)):
            found = require_features(spec, f"input {i}")
            if found != n_in:
                raise ValueError(f"input {i} has {found} features, expected in_features={n_in}")
        return Spec((self.out_features,), sequence=common_rows(specs))

    def product_weights(self):
        return tuple(self.weight_names)

    def forward(self, ctx):
        for i, (x, wname) in enumerate(zip(ctx.inputs, self.weight_names)):
            first = i == 0
            affine(self, ctx, x, wname, ctx.output, "bias" if first and self.has_bias else None, 0.0 if first else 1.0)
        self._activate(ctx)

    def backward(self, ctx):
        dz = self._grad_pre_activation(ctx)
        for i, (x, wname) in enumerate(zip(ctx.inputs, self.weight_names)):
            affine_backward(self, ctx, dz, x, wname, "bias" if i == 0 and self.has_bias else None, ctx.input_grad(i))

    def config(self):
        return {"in_features": self.in_features if self.multi else self.in_features[0],
                "out_features": self.out_features, "bias": self.has_bias, **self._act_config()}


@register
class Add(_Activated):
    """y = act(x_0 + x_1 + …), inputs of one shape (Paddle's addto)."""

    kind = "add"
    arity = (1, 64)

    def __init__(self, activation: str = "linear", slope: float = 0.01, name: Optional[str] = None) -> None:
        super().__init__(activation, slope, name)

    def output_spec(self, specs):
        return same_specs(specs, "Add")

    def forward(self, ctx):
        y = ctx.output
        for i, x in enumerate(ctx.inputs):
            ctx.be.axpby(1.0, x, 0.0 if i == 0 else 1.0, y)
        self._activate(ctx)

    def backward(self, ctx):
        dz = self._grad_pre_activation(ctx)
        for i in range(len(ctx.inputs)):
            dx = ctx.input_grad(i)
            if dx is not None:
                ctx.be.axpby(1.0, dz, dx.beta, dx.array)

    def config(self):
        return self._act_config()


@register
class Concat(Layer):
    """y = [x_0, x_1, …] along the feature axis; x_i [N, f_i] → y [N, Σ f_i]."""

    kind = "concat"
    arity = (1, 64)

    def output_spec(self, specs):
        widths = [require_features(s, f"input {i}") for i, s in enumerate(specs)]
        return Spec((sum(widths),), sequence=common_rows(specs))

    def _offsets(self, ctx):
        col = 0
        for x in ctx.inputs:
            yield col
            col += x.shape[1]

    def forward(self, ctx):
        for x, col in zip(ctx.inputs, self._offsets(ctx)):
            ctx.be.copy_to_columns(x, ctx.output, col)

    def backward(self, ctx):
        for i, col in enumerate(self._offsets(ctx)):
            dx = ctx.input_grad(i)
            if dx is not None:
                ctx.be.copy_from_columns(ctx.grad_output, col, dx.array, dx.beta)


@register
class Activation(_Activated):
    """y = act(x), element-wise (softmax: along the last axis)."""

    kind = "activation"
    fused = False

    def __init__(self, activation: str, slope: float = 0.01, name: Optional[str] = None) -> None:
        super().__init__(activation, slope, name)

    def output_spec(self, specs):
        return same_specs(specs, "Activation")

    def as_activation(self):
        return (self.activation, self.slope) if self.activation in ACTIVATIONS else None

    def forward(self, ctx):
        ctx.be.activation(self.activation, ctx.inputs[0], ctx.output, self.slope)

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is not None:
            # f' from the output y, or from the input x where y does not determine it
            z = ctx.inputs[0] if self.activation in INPUT_GRAD_ACTIVATIONS else ctx.output
            ctx.be.activation_backward(self.activation, z, ctx.grad_output, dx.array, dx.beta, self.slope)

    def config(self):
        return self._act_config()


@register
class PReLU(Layer):
    """y = max(x, 0) + a_c · min(x, 0), with a learned slope per channel (a sample's first axis:
    features, or the channels of [C, *spatial]) or one slope for everything (num_parameters=1),
    as torch.nn.PReLU; `weight` [num_parameters]."""

    kind = "prelu"

    def __init__(self, num_parameters: int = 1, init: float = 0.25, name: Optional[str] = None) -> None:
        super().__init__(name)
        self.num_parameters = int(num_parameters)
        if self.num_parameters < 1:
            raise ValueError(f"PReLU: num_parameters must be at least 1, found {num_parameters}")
        self.add_param("weight", constant(float(init), (self.num_parameters,)))

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if self.num_parameters != 1 and (not x.shape or x.shape[0] != self.num_parameters):
            raise ValueError(f"PReLU with {self.num_parameters} slopes: input 0 must have {self.num_parameters} "
                             f"channels (its first axis per sample), found {x}")
        return Spec(x.shape, sequence=x.sequence)

    def _channels(self, a):
        """a as [rows, slopes, the rest] (channel_bias's layout)."""
        return a.reshape(a.shape[0], self.num_parameters, -1)

    def _split(self, ctx, x):
        """(max(x, 0), min(x, 0), the slopes broadcast to x's shape) in workspaces."""
        be = ctx.be
        pos, neg, slopes = (ctx.workspace(k, x.shape) for k in ("positive", "negative", "slopes"))
        be.activation("relu", x, pos)
        be.copy(x, neg)
        be.axpby(-1.0, pos, 1.0, neg)
        be.fill(slopes, 0)
        be.channel_bias(slopes, self.params["weight"].buffer)
        return pos, neg, slopes

    def forward(self, ctx):
        y = self._channels(ctx.output)
        pos, neg, slopes = self._split(ctx, self._channels(ctx.inputs[0]))
        ctx.be.copy(pos, y)
        ctx.be.multiply(slopes, neg, y, beta=1.0)

    def backward(self, ctx):
        be = ctx.be
        dy = self._channels(ctx.grad_output)
        pos, neg, slopes = self._split(ctx, self._channels(ctx.inputs[0]))
        dx = ctx.input_grad(0)
        if dx is not None:
            through = ctx.workspace("through", dy.shape)  # dy where x > 0
            be.activation_backward("relu", pos, dy, through)
            rest = ctx.workspace("rest", dy.shape)  # dy where x <= 0
            be.copy(dy, rest)
            be.axpby(-1.0, through, 1.0, rest)
            target = self._channels(dx.array)
            be.axpby(1.0, through, dx.beta, target)
            be.multiply(slopes, rest, target, beta=1.0)
        da = ctx.param_grad("weight")
        if da is not None:
            product = ctx.workspace("through", dy.shape)
            be.multiply(dy, neg, product)
            be.channel_bias_grad(product, da.array, da.beta)

    def config(self):
        return {"num_parameters": self.num_parameters}


@register
class Dropout(Layer):
    """Training: y = x * m, m = 1/(1-p) with probability 1-p else 0 (inverted dropout, so the
    expected value is unchanged); inference: y = x."""

    kind = "dropout"

    def __init__(self, p: float = 0.5, name: Optional[str] = None) -> None:
        super().__init__(name)
        if not 0 <= p < 1:
            raise ValueError(f"Dropout: p must be in [0, 1), found {p}")
        self.p = float(p)

    def output_spec(self, specs):
        return same_specs(specs, "Dropout")

    def is_view(self):
        """At inference the output is the input."""
        return True

    def forward(self, ctx):
        x, y = ctx.inputs[0], ctx.output
        if not ctx.training or self.p == 0:
            ctx.be.copy(x, y)
            return
        mask = ctx.workspace("mask", x.shape)
        ctx.be.bernoulli_mask(mask, 1 - self.p, ctx.rng)
        ctx.be.multiply(x, mask, y)

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is None:
            return
        if self.p == 0:
            ctx.be.axpby(1.0, ctx.grad_output, dx.beta, dx.array)
        else:
            ctx.be.multiply(ctx.grad_output, ctx.workspace("mask", dx.array.shape), dx.array, dx.beta)

    def config(self):
        return {"p": self.p}


@register
class Scale(Layer):
    """y = factor * x."""

    kind = "scale"

    def __init__(self, factor: float, name: Optional[str] = None) -> None:
        super().__init__(name)
        self.factor = float(factor)

    def output_spec(self, specs):
        return same_specs(specs, "Scale")

    def forward(self, ctx):
        ctx.be.axpby(self.factor, ctx.inputs[0], 0.0, ctx.output)

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is not None:
            ctx.be.axpby(self.factor, ctx.grad_output, dx.beta, dx.array)

    def config(self):
        return {"factor": self.factor}


@register
class Bias(Layer):
    """y = x + b, b a parameter of one sample's shape added to every row (an ONNX Add of a
    constant; b [*shape])."""

    kind = "bias"

    def __init__(self, shape: Shape, name: Optional[str] = None) -> None:
        super().__init__(name)
        self.shape = tuple(int(s) for s in ((shape,) if isinstance(shape, int) else shape))
        self.add_param("bias", constant(0.0, self.shape))

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if x.shape != self.shape:
            raise ValueError(f"input 0 must have the bias's shape {list(self.shape)} per sample, found {x}")
        return Spec(x.shape, sequence=x.sequence)

    @staticmethod
    def _rows(a):
        return a.reshape(a.shape[0], a.size // a.shape[0])

    def forward(self, ctx):
        y = ctx.output
        ctx.be.axpby(1.0, ctx.inputs[0], 0.0, y)
        b = self.params["bias"].buffer
        ctx.be.add_bias(self._rows(y), b.reshape(b.size))

    def backward(self, ctx):
        dy = ctx.grad_output
        dx = ctx.input_grad(0)
        if dx is not None:
            ctx.be.axpby(1.0, dy, dx.beta, dx.array)
        db = ctx.param_grad("bias")
        if db is not None:
            ctx.be.bias_grad(self._rows(dy), db.array.reshape(db.array.size), db.beta)

    def config(self):
        return {"shape": list(self.shape)}


@register
class Multiply(Layer):
    """y = x_0 * x_1, element-wise, inputs of one shape (an ONNX Mul of two values)."""

    kind = "multiply"
    arity = (2, 2)

    def output_spec(self, specs):
        return same_specs(specs, "Multiply")

    def forward(self, ctx):
        a, b = ctx.inputs
        ctx.be.multiply(a, b, ctx.output)

    def backward(self, ctx):
        a, b = ctx.inputs
        dy = ctx.grad_output
        for slot, other in ((0, b), (1, a)):
            dx = ctx.input_grad(slot)
            if dx is not None:
                ctx.be.multiply(dy, other, dx.array, dx.beta)
