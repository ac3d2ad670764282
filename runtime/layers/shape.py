"""Layers that move each sample's values without computing on them: reshape, transpose, slice
of the first axis, broadcast over axes of size 1. Each is one pass over the values forward and
its adjoint backward (a gradient is added to, with beta, like every layer's)."""
from __future__ import annotations

import math
from typing import Optional, Sequence

import numpy as np

from ..graph import Spec
from .base import Layer, register, require_float
from ..types import Shape


@register
class Reshape(Layer):
    """y = each sample's values in another shape (row-major, same count), as torch.reshape of a
    sample; x [N, *in_shape] → y [N, *shape]. The copy is one pass (none at inference, where
    the output is the input's buffer when nothing else reads the input); backward copies back."""

    kind = "reshape"

    def __init__(self, shape: Shape, name: Optional[str] = None) -> None:
        super().__init__(name)
        self.shape = tuple(int(s) for s in ((shape,) if isinstance(shape, int) else shape))
        if not self.shape or min(self.shape) < 1:
            raise ValueError(f"Reshape: shape must be one or more sizes of at least 1, found {shape}")

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if math.prod(x.shape) != math.prod(self.shape):
            raise ValueError(f"cannot view a sample of shape {list(x.shape)} ({math.prod(x.shape)} values) as "
                             f"{list(self.shape)} ({math.prod(self.shape)} values)")
        return Spec(self.shape, sequence=x.sequence)

    def is_view(self):
        return True

    def forward(self, ctx):
        y = ctx.output
        ctx.be.copy(ctx.inputs[0].reshape(y.shape), y)

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is not None:
            ctx.be.axpby(1.0, ctx.grad_output.reshape(dx.array.shape), dx.beta, dx.array)

    def config(self):
        return {"shape": list(self.shape)}


@register
class Slice(Layer):
    """y = x[:, start:stop] along a sample's first axis (features, channels, or the directions of
    a recurrent layer's states); x [N, A, *rest] → y [N, stop - start, *rest], or [N, *rest]
    with squeeze=True for a single index (an ONNX Gather of a constant index, or a Slice)."""

    kind = "slice"

    def __init__(self, start: int, stop: int, squeeze: bool = False, name: Optional[str] = None) -> None:
        super().__init__(name)
        self.start, self.stop, self.squeeze = int(start), int(stop), bool(squeeze)
        if not 0 <= self.start < self.stop:
            raise ValueError(f"Slice: expected 0 <= start < stop, found start={start}, stop={stop}")
        if self.squeeze and self.stop != self.start + 1:
            raise ValueError(f"Slice: squeeze=True takes a single index (stop = start + 1), found {start}:{stop}")

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if not x.shape or x.shape[0] < self.stop:
            raise ValueError(f"Slice {self.start}:{self.stop}: input 0 must have at least {self.stop} entries "
                             f"along its first axis, found {x}")
        rest = x.shape[1:]
        shape = rest if self.squeeze and rest else (1,) if self.squeeze else (self.stop - self.start,) + rest
        return Spec(shape, sequence=x.sequence)

    def _columns(self, x):
        """x as rows of columns, and the first column of the slice."""
        inner = math.prod(x.shape[2:])
        return x.reshape(x.shape[0], -1), self.start * inner

    def forward(self, ctx):
        rows, col = self._columns(ctx.inputs[0])
        y = ctx.output
        ctx.be.copy_from_columns(rows, col, y.reshape(y.shape[0], -1))

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is None:
            return
        rows, col = self._columns(dx.array)
        if dx.beta == 0:
            ctx.be.fill(rows, 0)  # columns outside the slice get no gradient
        dy = ctx.grad_output
        ctx.be.copy_to_columns(dy.reshape(dy.shape[0], -1), rows, col, beta=1.0 if dx.beta else 0.0)

    def config(self):
        return {"start": self.start, "stop": self.stop, "squeeze": self.squeeze}


@register
class Broadcast(Layer):
    """y = x repeated along its per-sample axes of size 1 to `shape` (numpy's broadcasting of one
    sample, same rank); those axes must be one run: x [N, *P, 1…1, *R] → y [N, *P, *Q, *R].
    With R empty (a channel's value over its plane, a sample's scalar over its features) forward
    and backward are products with a vector of ones; otherwise a copy per position of Q."""

    kind = "broadcast"

    def __init__(self, shape: Shape, name: Optional[str] = None) -> None:
        super().__init__(name)
        self.shape = tuple(int(s) for s in ((shape,) if isinstance(shape, int) else shape))
        if not self.shape or min(self.shape) < 1:
            raise ValueError(f"Broadcast: shape must be one or more sizes of at least 1, found {shape}")

    def _run(self, x):
        """(P, Q, R): the sizes before, along and after the run of repeated axes."""
        grown = [i for i, (a, b) in enumerate(zip(x, self.shape)) if a != b]
        if not grown:
            return math.prod(x), 1, 1
        first, last = grown[0], grown[-1]
        if any(x[i] != 1 for i in range(first, last + 1)):
            raise ValueError(f"Broadcast to {list(self.shape)}: a sample of shape {list(x)} must have size 1 along "
                             f"axes {first}..{last} (one run of axes to repeat)")
        return math.prod(x[:first]), math.prod(self.shape[first:last + 1]), math.prod(x[last + 1:])

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if len(x.shape) != len(self.shape) or any(a not in (1, b) for a, b in zip(x.shape, self.shape)):
            raise ValueError(f"Broadcast: a sample of shape {list(x.shape)} does not broadcast to {list(self.shape)} "
                             f"(same number of axes, each of size 1 or the target's)")
        self._run(x.shape)
        return Spec(self.shape, sequence=x.sequence)

    def _ones(self, ctx, n, column):
        ones = ctx.workspace("ones", (n, 1) if column else (1, n))
        ctx.be.fill(ones, 1)
        return ones

    def forward(self, ctx):
        x, y = ctx.inputs[0], ctx.output
        p, q, r = self._run(x.shape[1:])
        src, dst = x.reshape(x.shape[0] * p, r), y.reshape(y.shape[0] * p, q * r)
        if r == 1:
            ctx.be.gemm(src, self._ones(ctx, q, column=False), dst)
        else:
            for k in range(q):
                ctx.be.copy_to_columns(src, dst, k * r)

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is None:
            return
        dy = ctx.grad_output
        p, q, r = self._run(dx.array.shape[1:])
        src, dst = dy.reshape(dy.shape[0] * p, q * r), dx.array.reshape(dx.array.shape[0] * p, r)
        if r == 1:
            ctx.be.gemm(src, self._ones(ctx, q, column=True), dst, beta=dx.beta)
        else:
            for k in range(q):
                ctx.be.copy_from_columns(src, k * r, dst, beta=dx.beta if k == 0 else 1.0)

    def config(self):
        return {"shape": list(self.shape)}


@register
class Transpose(Layer):
    """y = each sample's axes permuted (numpy's transpose of one sample): x [N, *shape] →
    y [N, *(shape[p] for p in perm)]. Forward gathers every element by its position in x,
    backward scatters the gradient back: a permutation moves each value once."""

    kind = "transpose"

    def __init__(self, perm: Sequence[int], name: Optional[str] = None) -> None:
        super().__init__(name)
        self.perm = tuple(int(p) for p in perm)
        if sorted(self.perm) != list(range(len(self.perm))):
            raise ValueError(f"Transpose: perm must order the axes 0..{len(self.perm) - 1}, found {list(perm)}")
        self._index: dict = {}  # rows -> the element index for that batch size

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if len(x.shape) != len(self.perm):
            raise ValueError(f"Transpose {list(self.perm)}: input 0 must have {len(self.perm)} axes per sample, "
                             f"found {x}")
        return Spec(tuple(x.shape[p] for p in self.perm), sequence=x.sequence)

    def _elements(self, rows, shape):
        """For y's elements in order, their positions in x (int32; rows · sample size of them)."""
        index = self._index.get(rows)
        if index is None:
            size = math.prod(shape)
            if rows * size >= 2 ** 31:
                raise ValueError(f"Transpose: {rows} rows of {size} values exceed the int32 element index")
            within = np.arange(size, dtype=np.int64).reshape(shape).transpose(self.perm).reshape(-1)
            index = (np.arange(rows, dtype=np.int64)[:, None] * size + within).reshape(-1).astype(np.int32)
            if len(self._index) > 8:
                self._index.clear()
            self._index[rows] = index
        return index

    def forward(self, ctx):
        x, y = ctx.inputs[0], ctx.output
        index = self._elements(x.shape[0], x.shape[1:])
        ctx.be.gather_rows(x.reshape(x.size, 1), index, y.reshape(y.size, 1))

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is not None:
            dy = ctx.grad_output
            index = self._elements(dx.array.shape[0], dx.array.shape[1:])
            ctx.be.scatter_rows(dy.reshape(dy.size, 1), index, dx.array.reshape(dx.array.size, 1), beta=dx.beta)

    def config(self):
        return {"perm": list(self.perm)}
