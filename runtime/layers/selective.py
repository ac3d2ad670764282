"""The selective fully-connected layer and the costs over its selected outputs: for output layers
over large vocabularies, score only the columns asked for (a lamina.Selection per batch: the
labels plus sampled negatives while training, a candidate list while decoding).

Three ways to compute the selected scores, all giving the same numbers:
- per-row sparse: one dot product per entry, x[i] · W[c], walking the selected columns in
  increasing order (each needed row of W read once per batch, in address order); backward in
  one more such pass writes only the selected rows of W's gradient;
- shared sparse: gather the k selected rows of W once, then one GEMM [rows, in] x [in, k];
- dense: the full GEMM [rows, out], then gather the entries; when the selection is dense enough
  that the GEMM's speed beats the work saved.
"""
from __future__ import annotations

from typing import Optional, Sequence, Union

from ..backends.base import check_activation
from ..errors import InputError
from ..graph import Spec
from ..precision import product_precision
from .base import Layer, common_rows, register
from .dense import Linear

# A per-row selection with more entries than this fraction of the full product (rows x out)
# runs on the dense path: the sparse path streams the selected rows of W at memory speed, the
# dense one runs the full GEMM at the compute peak, and they cross near this density
# (`python -m bench selective --only crossover` measures it; Paddle's legacy layer switched at
# 0.02).
DENSE_RATIO = 0.14
# a shared selection runs as a GEMM over gathered rows of W; the full GEMM only pays when nearly
# every column is selected
SHARED_DENSE_RATIO = 0.9

PATHS = ("auto", "sparse", "dense")
SELECTED_ACTIVATIONS = ("linear", "exponential", "softmax")


@register
class SelectiveLinear(Linear):
    """y[e] = act(Σ_i x_i[row(e)] · W_i[col(e)] + b[col(e)]) for each entry e of the batch's
    selection (the last input, a 'selection' value); without a selection input it is Linear.
    Weights as torch.nn.Linear ([out, in_i], bias [out]); act is linear, exponential, or softmax
    over each row's entries. The output is [rows, k] for a shared selection and one value per
    entry (the selection's row offsets) for a per-row one. Weight and bias gradients touch only
    the selected rows (sparse: optimizers update just those rows where that is exact). In a
    bfloat16 run (`astype`, `autocast`) every path multiplies x and W rounded to bfloat16, summed
    in float32, as Linear does."""

    kind = "selective_linear"

    def __init__(self, in_features: Union[int, Sequence[int]], out_features: int, bias: bool = True,
                 activation: str = "linear", path: str = "auto", dense_ratio: Optional[float] = None,
                 slope: float = 0.01, name: Optional[str] = None) -> None:
        if check_activation(activation, "SelectiveLinear") not in SELECTED_ACTIVATIONS:
            raise ValueError(f"SelectiveLinear: activation must be one of {', '.join(SELECTED_ACTIVATIONS)}, "
                             f"found {activation!r}")
        if path not in PATHS:
            raise ValueError(f"SelectiveLinear: path must be one of {', '.join(PATHS)}, found {path!r}")
        super().__init__(in_features, out_features, bias, activation, slope, name)
        self.path = path
        self.dense_ratio = DENSE_RATIO if dense_ratio is None else float(dense_ratio)
        for p in self.params.values():
            p.row_gradients = True
        n = len(self.in_features)
        self.arity = (n, n + 1)

    def config(self):
        return {**super().config(), "path": self.path, "dense_ratio": self.dense_ratio}

    def output_spec(self, specs):
        n = len(self.in_features)
        spec = super().output_spec(specs[:n])
        if len(specs) == n:
            return spec
        if specs[n].kind != "selection":
            raise ValueError(f"input {n} must be a selection (net.input(name, dtype='selection')), "
                             f"found {specs[n]}")
        return Spec((), sequence=common_rows(specs[:n]), selected=True)

    def _choose_path(self, selection, rows):
        if self.path != "auto":
            return self.path
        density = selection.num_entries(rows) / (rows * self.out_features)
        return "dense" if density > (SHARED_DENSE_RATIO if selection.is_shared else self.dense_ratio) else "sparse"

    def _weights(self, ctx):
        return [(x, self.params[w]) for x, w in zip(ctx.inputs, self.weight_names)]

    # ---------------------------------------------------------------- forward
    def forward(self, ctx):
        n = len(self.in_features)
        if len(ctx.inputs) == n:
            return super().forward(ctx)
        be, sel = ctx.be, ctx.inputs[n]
        rows = ctx.inputs[0].shape[0]
        sel.check(rows, self.out_features, ctx.node.describe())
        out = ctx.selected_output(sel, rows)
        starts, cols = sel.starts(rows), sel.columns
        path, products = self._choose_path(sel, rows), _products(ctx)
        if path == "dense":
            full = ctx.workspace("full", (rows, self.out_features))
            for i, (x, w) in enumerate(self._weights(ctx)):
                be.gemm_in(products, x, w.buffer, full, trans_b=True, beta=0.0 if i == 0 else 1.0)
            if self.has_bias:
                be.add_bias(full, self.bias.buffer)
            be.gather_entries(full, starts, cols, sel.is_shared, out)
        elif sel.is_shared:
            out2 = out.reshape(rows, sel.width)
            for i, (x, w) in enumerate(self._weights(ctx)):
                w_sel = ctx.workspace(f"w_sel{i}", (sel.width, x.shape[1]))
                be.gather_rows(w.buffer, cols, w_sel)
                be.gemm_in(products, x, w_sel, out2, trans_b=True, beta=0.0 if i == 0 else 1.0)
            if self.has_bias:
                b_sel = ctx.workspace("b_sel", (sel.width,))
                be.gather_rows(self.bias.buffer, cols, b_sel)
                be.add_bias(out2, b_sel)
        else:
            by_column = sel.by_column(self.out_features)
            for i, (x, w) in enumerate(self._weights(ctx)):
                be.selected_dots_in(products, x, w.buffer, by_column, out, beta=0.0 if i == 0 else 1.0)
            if self.has_bias:
                be.add_selected_bias(out, self.bias.buffer, cols)
        if self.activation == "exponential":
            be.activation("exponential", out, out)
        elif self.activation == "softmax":
            be.sequence_softmax(out, starts, out)

    # ---------------------------------------------------------------- backward
    def backward(self, ctx):
        n = len(self.in_features)
        if len(ctx.inputs) == n:
            return super().backward(ctx)
        be, sel = ctx.be, ctx.inputs[n]
        rows = ctx.inputs[0].shape[0]
        starts = sel.starts(rows)
        dz = self._selected_grad_pre_activation(ctx, starts)
        path = self._choose_path(sel, rows)
        if path == "dense":
            self._backward_dense(ctx, dz, sel, rows)
            return
        if sel.is_shared:
            self._backward_shared(ctx, dz.reshape(rows, sel.width), sel)
            return
        by_column = sel.by_column(self.out_features)
        for i, (x, w) in enumerate(self._weights(ctx)):
            dx = ctx.input_grad(i)
            dw = ctx.sparse_param_target(self.weight_names[i], by_column[0])
            if dx is not None or dw is not None:
                be.selected_backward_in(_products(ctx), dz, x, w.buffer, by_column,
                                        *(dx.array, dx.beta) if dx else (None, 0.0),
                                        *(dw.array, dw.beta) if dw else (None, 0.0))
        if self.has_bias:
            db = ctx.sparse_param_target("bias", by_column[0])
            if db is not None:
                be.selected_bias_grad(dz, by_column, db.array, db.beta)

    def _selected_grad_pre_activation(self, ctx, starts):
        dy, y = ctx.grad_output, ctx.output
        if self.activation == "linear":
            return dy
        dz = ctx.workspace("dz", dy.shape)
        if self.activation == "exponential":
            ctx.be.multiply(dy, y, dz)  # d exp(z) / dz = exp(z)
        else:
            ctx.be.sequence_softmax_backward(y, dy, starts, dz)
        return dz

    def _backward_dense(self, ctx, dz, sel, rows):
        """The output gradient scattered into a full [rows, out] matrix, then Linear's GEMMs."""
        be = ctx.be
        g = ctx.workspace("full", (rows, self.out_features))
        be.scatter_entries(dz, sel.starts(rows), sel.columns, sel.is_shared, g)
        for i, (x, w) in enumerate(self._weights(ctx)):
            dx = ctx.input_grad(i)
            if dx is not None:
                be.gemm_in(_products(ctx), g, w.buffer, dx.array, beta=dx.beta)
            dw = ctx.param_grad(self.weight_names[i])
            if dw is not None:
                be.gemm_in(_products(ctx), g, x, dw.array, trans_a=True, beta=dw.beta)
        if self.has_bias:
            db = ctx.param_grad("bias")
            if db is not None:
                be.bias_grad(g, db.array, db.beta)

    def _backward_shared(self, ctx, g, sel):
        """GEMMs against the gathered rows; the selected rows' gradients are scattered back."""
        be = ctx.be
        distinct, _ = sel.distinct()
        for i, (x, w) in enumerate(self._weights(ctx)):
            w_sel = ctx.workspace(f"w_sel{i}", (sel.width, x.shape[1]))
            dx = ctx.input_grad(i)
            if dx is not None:
                be.gemm_in(_products(ctx), g, w_sel, dx.array, beta=dx.beta)
            dw = ctx.sparse_param_target(self.weight_names[i], distinct)
            if dw is not None:
                dw_sel = ctx.workspace(f"dw_sel{i}", w_sel.shape)
                be.gemm_in(_products(ctx), g, x, dw_sel, trans_a=True)
                self._scatter_selected(be, dw_sel, sel, distinct, dw)
        if self.has_bias:
            db = ctx.sparse_param_target("bias", distinct)
            if db is not None:
                db_sel = ctx.workspace("db_sel", (sel.width,))
                be.bias_grad(g, db_sel)
                self._scatter_selected(be, db_sel, sel, distinct, db)

    @staticmethod
    def _scatter_selected(be, src, sel, distinct, target):
        """target rows sel.columns (+)= src rows; a column listed twice gets the sum."""
        if len(distinct) == sel.width:
            be.scatter_rows(src, sel.columns, target.array, target.beta)
        else:
            if target.beta == 0:
                be.fill_rows(target.array, distinct, 0)
            be.scatter_add_rows(src, sel.columns, target.array)


def _products(ctx):
    """The precision the selection's products run in: bfloat16 in a bfloat16 run (x and W rounded,
    sums in float32, as Linear's), else float32 (an int8 network's selection multiplies its
    float32 values)."""
    return product_precision(ctx.precision)


class _SelectedCost(Layer):
    """A cost over a selective layer's output: inputs (scores, labels, selection[, weights]);
    labels are true class ids (int32, one per row), found in each row's selection (a label the
    row does not select is an error naming the row); output one cost per row."""

    is_cost = True
    arity = (3, 4)

    def output_spec(self, specs):
        scores, labels, selection = specs[:3]
        if not scores.selected:
            raise ValueError(f"input 0 must be a selective layer's output over a selection, found {scores}")
        if labels.kind != "int32" or labels.shape != ():
            raise ValueError(f"input 1 (the labels) must be one int32 class id per row, found {labels}")
        if selection.kind != "selection":
            raise ValueError(f"input 2 must be the selection the scores were computed for, found {selection}")
        out = Spec((), sequence=labels.sequence)
        if len(specs) == 4 and specs[3] != out:
            raise ValueError(f"input 3 (the row weights) must be one float per row, found {specs[3]}")
        return out

    def grad_slots(self, n_inputs):
        return (0,)

    def _prepare(self, ctx):
        """(scores, selection, entry offsets, label entries, row weights or None)."""
        inputs = ctx.inputs
        scores, sel = inputs[0], inputs[2]
        labels = ctx.host_input(1)  # positions are found on the host, where the caller's labels are
        rows = len(labels)
        starts = sel.starts(rows)
        if starts[-1] != scores.shape[0]:
            raise InputError(f"{ctx.node.describe()}: {rows} labels, but the scores hold "
                             f"{scores.shape[0]} entries, not those of {rows} rows of {sel}")
        try:
            pos = sel.label_entries(labels)
        except InputError as e:
            raise InputError(f"{ctx.node.describe()}: {e}") from None
        return scores, sel, starts, pos, (inputs[3] if len(inputs) == 4 else None)


@register
class SelectedCrossEntropy(_SelectedCost):
    """cost_i = -w_i log softmax(z_i - logq_i)[label_i] over row i's entries: the softmax
    cross-entropy of a selective layer's linear scores z (logits, not probabilities); logq is the
    selection's sampled-softmax correction (none: 0)."""

    kind = "selected_cross_entropy"

    def forward(self, ctx):
        z, sel, starts, pos, w = self._prepare(ctx)
        shift = sel.entry_logq(len(pos), z.dtype)
        ctx.be.segment_cross_entropy(z, starts, pos, shift, w, ctx.workspace("probs", z.shape), ctx.output)

    def backward(self, ctx):
        dz = ctx.input_grad(0)
        if dz is not None:
            z, sel, starts, pos, w = self._prepare(ctx)
            ctx.be.segment_cross_entropy_backward(ctx.workspace("probs", z.shape), starts, pos, w,
                                                  ctx.grad_output, dz.array, dz.beta)


@register
class SelfNormalizedCost(_SelectedCost):
    """cost_i = w_i (-log o[label_i] + log S_i + alpha (log S_i)²), S_i = Σ_row o, over a selective
    layer's exponential outputs o: cross-entropy plus a penalty that drives log S to 0, so a
    trained model's exp outputs are nearly normalised and inference can skip the sum."""

    kind = "self_normalized_cost"

    def __init__(self, alpha: float = 0.1, name: Optional[str] = None) -> None:
        super().__init__(name)
        if alpha < 0:
            raise ValueError(f"SelfNormalizedCost: alpha must be at least 0, found {alpha}")
        self.alpha = float(alpha)

    def config(self):
        return {"alpha": self.alpha}

    def forward(self, ctx):
        o, sel, starts, pos, w = self._prepare(ctx)
        ctx.be.segment_self_normalized(o, starts, pos, self.alpha, w, ctx.output)

    def backward(self, ctx):
        do = ctx.input_grad(0)
        if do is not None:
            o, sel, starts, pos, w = self._prepare(ctx)
            ctx.be.segment_self_normalized_backward(o, starts, pos, self.alpha, w, ctx.grad_output,
                                                    do.array, do.beta)
