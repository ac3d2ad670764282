"""Cost layers. Each outputs one cost per row, [N]; the network's loss is the mean over rows of
every cost among its outputs. An optional last input gives per-row weights [N] (cost_i * w_i);
labels and weights receive no gradient.

A cost built with objective=False is a score instead: the same per-row values, computed when an
output asks for them (a language model's per-token negative log-likelihood for scoring), never
part of the loss that training minimises, and served and exported like any prediction."""
from __future__ import annotations

from typing import Optional

from ..graph import Spec
from .base import Layer, check_ids, common_rows, register, require_float


class _Cost(Layer):
    is_cost = True
    arity = (2, 3)
    target_kind = "float"

    def __init__(self, name: Optional[str] = None, objective: bool = True) -> None:
        super().__init__(name)
        self.is_cost = bool(objective)

    def config(self):
        return {} if self.is_cost else {"objective": False}

    def output_spec(self, specs):
        require_float(specs[0], "input 0 (the prediction)")
        target = specs[1]
        if target.kind != self.target_kind:
            raise ValueError(f"input 1 (the target) must be {self.target_kind}, found {target}")
        self.check_target(specs[0], target)
        sequence = common_rows(specs)
        if len(specs) == 3 and specs[2] != Spec((), sequence=sequence):
            raise ValueError(f"input 2 (the row weights) must be one float per row, found {specs[2]}")
        return Spec((), sequence=sequence)

    def check_target(self, prediction, target):
        if target != prediction:
            raise ValueError(f"input 1 (the target) must match the prediction {prediction}, found {target}")

    @staticmethod
    def _weights(ctx):
        inputs = ctx.inputs
        return inputs[2] if len(inputs) == 3 else None


@register
class SoftmaxCrossEntropy(_Cost):
    """cost_i = -w_i log softmax(x_i)[y_i]; x [N, classes] logits, y [N] int32 class ids."""

    kind = "softmax_cross_entropy"
    target_kind = "int32"

    def check_target(self, prediction, target):
        if len(prediction.shape) != 1:
            raise ValueError(f"input 0 (the logits) must be [classes] per sample, found {prediction}")
        if target.shape != ():
            raise ValueError(f"input 1 (the labels) must be one int32 class id per row, found {target}")

    def grad_slots(self, n_inputs):
        return (0,)

    def forward(self, ctx):
        x = ctx.inputs[0]
        labels = ctx.host_input(1)  # the host snapshot: checked here, read by forward and backward
        check_ids(ctx, labels, x.shape[1], "labels (input 1)")
        probs = ctx.workspace("probs", x.shape) if ctx.training else None  # (backward reads them)
        ctx.be.softmax_cross_entropy(x, labels, self._weights(ctx), probs, ctx.output)

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is not None:
            x = ctx.inputs[0]
            ctx.be.softmax_cross_entropy_backward(ctx.workspace("probs", x.shape), ctx.host_input(1),
                                                  self._weights(ctx), ctx.grad_output, dx.array, dx.beta)


class _PairCost(_Cost):
    """A cost of a prediction and a float target of the same shape; both may take a gradient."""

    def grad_slots(self, n_inputs):
        return (0, 1)

    def forward(self, ctx):
        x, t = ctx.inputs[:2]
        self.cost(ctx.be)(x, t, self._weights(ctx), ctx.output)

    def backward(self, ctx):
        x, t = ctx.inputs[:2]
        for slot in (0, 1):
            g = ctx.input_grad(slot)
            if g is not None:
                self.cost_backward(ctx.be)(x, t, self._weights(ctx), ctx.grad_output, g.array,
                                           wrt_target=slot == 1, beta=g.beta)


@register
class SquareError(_PairCost):
    """cost_i = w_i Σ_j (x_ij - t_ij)² (summed over features; torch's MSELoss averages instead)."""

    kind = "square_error"

    def cost(self, be):
        return be.square_error

    def cost_backward(self, be):
        return be.square_error_backward


@register
class BCEWithLogits(_PairCost):
    """cost_i = w_i Σ_j max(x,0) - x t + log(1 + e^{-|x|}): binary cross-entropy of sigmoid(x)
    against targets t in [0, 1], in the overflow-free form."""

    kind = "bce_with_logits"

    def cost(self, be):
        return be.bce_with_logits

    def cost_backward(self, be):
        return be.bce_with_logits_backward
