"""Choosing values by a condition: Compare (a 0/1 mask from the sign of a value) and Where (a
branch per element by such a mask), ONNX's comparisons and Where.

Masks are float values holding 0 and 1, so they pass through the graph like any value; they take
no gradient (Compare passes none back), and Where's gradient goes to the branch each element took.
"""
from __future__ import annotations

from typing import Iterable, Optional

from ..graph import Spec
from ..types import Shape
from .base import Layer, constant, register, require_float

# Compare's tests of x against 0, from Backend.select, which takes its first branch where the
# condition is > 0 (so NaN takes the second)
COMPARISONS = ("greater", "less", "greater_equal", "less_equal", "equal")


def _rows(be, name, value, row, dtype):
    """A scratch row of `row` copies of `value` (select's broadcast branch)."""
    r = be.scratch(("select", name), (row,), dtype)
    be.fill(r, value)
    return r


@register
class Compare(Layer):
    """y = 1 where `x op 0` holds, else 0 (op: 'greater', 'less', 'greater_equal', 'less_equal',
    'equal'); compare two values by their difference (x - y > 0 exactly when x > y in floats).
    Every test fails for NaN (0), as ONNX's comparisons. No gradient: the mask is piecewise
    constant."""

    kind = "compare"

    def __init__(self, op: str, name: Optional[str] = None) -> None:
        super().__init__(name)
        if op not in COMPARISONS:
            raise ValueError(f"Compare: op must be one of {', '.join(COMPARISONS)}, found {op!r}")
        self.op = op

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        return Spec(x.shape, sequence=x.sequence)

    def grad_slots(self, n_inputs):
        return ()

    def forward(self, ctx):
        be, x, y = ctx.be, ctx.inputs[0], ctx.output
        if y.size == 0:
            return
        row = x.size // x.shape[0]
        ones, zeros = _rows(be, "ones", 1.0, row, x.dtype), _rows(be, "zeros", 0.0, row, x.dtype)
        if self.op in ("less", "greater_equal", "equal"):
            negated = be.scratch(("compare", "negated"), x.shape, x.dtype)
            be.axpby(-1.0, x, 0.0, negated)
        if self.op == "greater":
            be.select(x, ones, zeros, y)
        elif self.op == "less":
            be.select(negated, ones, zeros, y)
        else:  # the tests that hold at 0: 0 where they fail, else 1 but for NaN
            be.select(self._not_nan(be, x), ones, zeros, y)
            if self.op in ("less_equal", "equal"):
                be.select(x, zeros, y, y)
            if self.op in ("greater_equal", "equal"):
                be.select(negated, zeros, y, y)

    @staticmethod
    def _not_nan(be, x):
        """x² + 1: above 0 everywhere but where x is NaN (select's condition for 'x is a number')."""
        square = be.scratch(("compare", "square"), x.shape, x.dtype)
        be.multiply(x, x, square)
        ones = be.scratch(("compare", "ones"), x.shape, x.dtype)
        be.fill(ones, 1.0)
        be.axpby(1.0, ones, 1.0, square)
        return square

    def backward(self, ctx):
        pass

    def config(self):
        return {"op": self.op}


@register
class Where(Layer):
    """y = a where cond > 0, else b, element-wise (ONNX's Where, its condition a Compare's mask).
    Each operand is an input or, where named in `fixed`, a constant of one sample's `shape` held
    as a frozen parameter ('cond', 'a', 'b'; set it with Parameter.assign, saved with the model);
    the inputs come in the order cond, a, b of those not fixed. The gradient reaches the branch
    each element took; the condition gets none."""

    kind = "where"
    arity = (1, 3)
    OPERANDS = ("cond", "a", "b")

    def __init__(self, shape: Shape, fixed: Iterable[str] = (), name: Optional[str] = None) -> None:
        super().__init__(name)
        self.shape = tuple(int(s) for s in ((shape,) if isinstance(shape, int) else shape))
        self.fixed = tuple(k for k in self.OPERANDS if k in set(fixed))
        unknown = set(fixed) - set(self.OPERANDS)
        if unknown or len(self.fixed) == 3:
            raise ValueError(f"Where: fixed must name at most two of cond, a, b, found {sorted(fixed)}")
        self.arity = (3 - len(self.fixed),) * 2
        for k in self.fixed:
            p = self.add_param(k, constant(0.0, self.shape))
            p.frozen = True

    def _inputs(self):
        return [k for k in self.OPERANDS if k not in self.fixed]

    def output_spec(self, specs):
        for k, s in zip(self._inputs(), specs):
            require_float(s, k)
            if s.shape != self.shape or s.sequence != specs[0].sequence:
                raise ValueError(f"{k} must be {list(self.shape)} per sample like the other operands, found {s}")
        return Spec(self.shape, sequence=specs[0].sequence)

    def grad_slots(self, n_inputs):
        return tuple(i for i, k in enumerate(self._inputs()) if k != "cond")

    def _operands(self, ctx):
        given = dict(zip(self._inputs(), ctx.inputs))
        return [given[k] if k in given else self.params[k].buffer for k in self.OPERANDS]

    def forward(self, ctx):
        cond, a, b = self._operands(ctx)
        if cond.size != ctx.output.size:  # a fixed condition: one row for every row
            cond = self._cond_rows(ctx, cond)
        ctx.be.select(cond, a, b, ctx.output)

    def _cond_rows(self, ctx, cond):
        """A fixed condition as every row's (select reads a condition of the output's shape)."""
        be, y = ctx.be, ctx.output
        full = be.scratch(("where", "cond"), y.shape, y.dtype)
        be.select(full, cond, cond, full)  # (either branch is the row: what full held does not matter)
        return full

    def backward(self, ctx):
        be, g = ctx.be, ctx.grad_output
        cond = self._operands(ctx)[0]
        if cond.size != g.size:
            cond = self._cond_rows(ctx, cond)
        row = g.size // g.shape[0] if g.shape[0] else 0
        zeros = _rows(be, "zeros", 0.0, row, g.dtype)
        for slot, k in enumerate(self._inputs()):
            target = ctx.input_grad(slot) if k != "cond" else None
            if target is None or g.size == 0:
                continue
            chosen = (g, zeros) if k == "a" else (zeros, g)
            if target.beta == 0:
                be.select(cond, *chosen, target.array)
            else:
                part = be.scratch(("where", "grad"), g.shape, g.dtype)
                be.select(cond, *chosen, part)
                be.axpby(1.0, part, target.beta, target.array)

    def config(self):
        return {"shape": list(self.shape), "fixed": list(self.fixed)}
