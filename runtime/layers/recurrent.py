"""Recurrent layers over variable-length sequence batches: RNN, LSTM, GRU.

PyTorch's parameters, layouts and gate orders (weight_ih_l{k}[_reverse] [G·H, in],
weight_hh_l{k} [G·H, H], bias_ih_l{k}, bias_hh_l{k}; LSTM gates i, f, g, o; GRU r, z, n with the
reset gate applied to the recurrent product, bias included), so weights copy over unchanged.

Per layer and direction, nothing pads:
- the rows are gathered into time-major order (lamina.sequence.BatchOrder: longest first, step t
  holds every sequence longer than t, and the first rows of step t-1 are their previous states);
- the input projection of every step is one GEMM, G = X W_ihᵀ + b;
- each step adds h_{t-1} W_hhᵀ to its block of G with one GEMM over the running sequences
  against W_hh packed once per weight version (MKL's packed GEMM where MKL is the provider, else
  lamina's panel GEMM, pyx/panels.h) and applies the cell in one fused kernel;
- backward walks the steps in reverse, adding dG_t W_hh into the previous step's rows, and
  after the loop computes every weight gradient as one GEMM over all steps: dW_hh = dGᵀ H_prev,
  where H_prev holds each row's previous state (time-major, built by copying step blocks). One
  GEMM with k = total steps beats both Paddle's options (per-step accumulation, or one GEMM per
  sequence).

Inputs: x (sequence, [input_size]), optional initial states h0 [N, L·D, H] (and c0 for LSTM),
sample-major (PyTorch's are [L·D, N, H]). Outputs: every step's hidden state (sequence,
[D·H], directions concatenated as PyTorch does), the last states '<node>.last' [N, L·D, H] and,
for LSTM, '<node>.cell'. A reversed direction's last state is its state after the sequence's
first row, as in PyTorch.
"""
from __future__ import annotations

import math
from typing import Optional

from ..graph import Spec
from ..backends.stepwise import Direction
from ..scheduler import GradTarget
from ..random import generator
from .base import Layer, register, require_float, uniform

# input projections of at most this many rows (a lone request's steps) use the packed W_ih, as
# the recurrent products use W_hh: a general GEMM copies (packs) its whole right-hand operand at
# every call, which for a few rows costs more than the product itself; from a few hundred rows
# the general GEMM is faster again
PACKED_INPUT_ROWS = 256


class _Recurrent(Layer):
    gates = 1
    cell_state = False
    initial_state_slots = (1, 2)  # h0 and c0

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 bidirectional: bool = False, reverse: bool = False, packed: Optional[bool] = None,
                 name: Optional[str] = None) -> None:
        super().__init__(name)
        self.input_size, self.hidden_size = int(input_size), int(hidden_size)
        self.num_layers, self.has_bias = int(num_layers), bool(bias)
        self.bidirectional, self.reverse, self.packed = bool(bidirectional), bool(reverse), packed
        where = type(self).__name__
        if min(self.input_size, self.hidden_size, self.num_layers) < 1:
            raise ValueError(f"{where}: input_size, hidden_size and num_layers must be at least 1, found "
                             f"{input_size}, {hidden_size}, {num_layers}")
        if self.bidirectional and self.reverse:
            raise ValueError(f"{where}: reverse=True walks one direction backwards; a bidirectional "
                             f"layer already has both")
        self.directions = 2 if self.bidirectional else 1
        states = 3 if self.cell_state else 2
        self.arity = (1, states)
        self.output_labels = ("", "last", "cell")[:states]
        H, GH = self.hidden_size, self.gates * self.hidden_size
        bound = 1 / math.sqrt(H)  # PyTorch's U(-1/sqrt(H), 1/sqrt(H)) for every parameter
        rng = generator()
        for l in range(self.num_layers):
            n_in = self.input_size if l == 0 else H * self.directions
            for d in range(self.directions):
                sfx = self._suffix(l, d)
                self.add_param("weight_ih" + sfx, uniform(rng, bound, (GH, n_in)))
                self.add_param("weight_hh" + sfx, uniform(rng, bound, (GH, H)))
                if self.has_bias:
                    self.add_param("bias_ih" + sfx, uniform(rng, bound, (GH,)))
                    self.add_param("bias_hh" + sfx, uniform(rng, bound, (GH,)))

    @staticmethod
    def _suffix(l, d):
        return f"_l{l}" + ("_reverse" if d else "")

    def _reversed(self, d):
        return d == 1 or self.reverse

    def config(self):
        return {"input_size": self.input_size, "hidden_size": self.hidden_size, "num_layers": self.num_layers,
                "bias": self.has_bias, "bidirectional": self.bidirectional, "reverse": self.reverse,
                "packed": self.packed}

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if not x.sequence or x.shape != (self.input_size,):
            raise ValueError(f"input 0 must be a sequence batch of [{self.input_size}] rows, found {x}")
        state = Spec((self.num_layers * self.directions, self.hidden_size))
        for i, s in enumerate(specs[1:], 1):
            if s != state:
                raise ValueError(f"input {i} (initial {'cell' if i == 2 else 'hidden'} state) must be "
                                 f"{state} per sequence, found {s}")
        out = Spec((self.directions * self.hidden_size,), sequence=True)
        return (out, state, state)[:len(self.output_labels)]

    def product_weights(self):
        return tuple(name for name in self.params if name.startswith(("weight_ih", "weight_hh")))

    # ------------------------------------------------------------------ shared pieces
    def uses_packed(self, be):
        """Whether the recurrent products use W_hh packed (Backend.pack): as the layer says, else
        as the backend prefers (the CPU's: MKL's format on MKL, lamina's panels elsewhere)."""
        if self.packed is None:
            return be.packs_recurrent_weights
        return bool(self.packed)

    def _weight_product(self, ctx, a, name, out, beta, transpose, rows=None, bias=None):
        """out = a @ Wᵀ (transpose) or a @ W, plus beta * out (or, given a bias, plus the bias
        instead), W the parameter `name` (W_hh, or W_ih for few rows); packed when enabled, for
        products of up to `rows` rows (default: the batch's sequences, a step's most)."""
        be, w = ctx.be, self.params[name]
        if self.uses_packed(be) or ctx.precision != "float32":
            packed = self._pack(ctx, w, transpose, rows)
            if bias is not None:
                be.packed_gemm_bias(a, packed, out, bias)
            else:
                be.packed_gemm(a, packed, out, beta)
        elif bias is not None:
            be.gemm_bias(a, w.buffer, out, bias, trans_b=transpose)
        else:
            be.gemm(a, w.buffer, out, trans_b=transpose, beta=beta)

    def _pack(self, ctx, w, transpose, rows=None, method="pack"):
        """op(w) packed for the backend (Layer.packed_weight, by the backend's `method`), for up to
        `rows` rows (default: the batch's sequences)."""
        return self.packed_weight(ctx.be, w, transpose, rows or ctx.order.num_sequences, ctx.precision, method)

    def recurrent_pack(self, ctx, sfx, transpose, method="pack"):
        """W_hh of one direction packed (transposed for the forward's h W_hhᵀ)."""
        return self._pack(ctx, self.params["weight_hh" + sfx], transpose, method=method)

    def _sorted_state(self, ctx, state, k, key):
        """Initial state k of every sequence, in the batch order's sorted order, or None."""
        if state is None:
            return None
        out = ctx.workspace((key, k), (ctx.order.num_sequences, self.hidden_size))
        ctx.be.gather_rows(state, ctx.order.order, out, col=k * self.hidden_size)
        return out

    def workspace(self, ctx, key, l, d, width):
        return ctx.workspace((key, l, d), (ctx.order.step_starts[-1], width))

    # ------------------------------------------------------------------ forward
    def forward(self, ctx):
        ins, outs = ctx.inputs, ctx.outputs
        h0, c0 = (ins + [None, None])[1:3]
        D, H, L = self.directions, self.hidden_size, self.num_layers
        layer_in = ins[0]
        for l in range(L):
            layer_out = outs[0] if l == L - 1 else self.workspace(ctx, "out", l, 0, D * H)
            for d in range(D):
                self._forward_direction(ctx, l, d, layer_in, layer_out, h0, c0, outs)
            layer_in = layer_out

    def _forward_direction(self, ctx, l, d, layer_in, layer_out, h0, c0, outs):
        be, order, H = ctx.be, ctx.order, self.hidden_size
        sfx, k = self._suffix(l, d), l * self.directions + d
        index = order.index(self._reversed(d))
        xs = self.workspace(ctx, "x", l, d, layer_in.shape[1])
        be.gather_rows(layer_in, index, xs)
        g = self.workspace(ctx, "g", l, d, self.gates * H)
        bias = None
        if self.has_bias:
            bias = self.params["bias_ih" + sfx].buffer
            if not self.separate_recurrent_bias:  # b_ih + b_hh once
                both = ctx.workspace(("bias", l, d), bias.shape)
                be.axpby(1.0, bias, 0.0, both)
                be.axpby(1.0, self.params["bias_hh" + sfx].buffer, 1.0, both)
                bias = both
        # G = X W_ihᵀ + bias, the bias added as the product stores (no pass of its own over G);
        # from W_ih's pack for few rows (a general GEMM would copy all of W_ih for them), and in
        # another precision
        if xs.shape[0] <= PACKED_INPUT_ROWS or ctx.precision != "float32":
            self._weight_product(ctx, xs, "weight_ih" + sfx, g, 0.0, True, rows=xs.shape[0], bias=bias)
        elif bias is not None:
            be.gemm_bias(xs, self.params["weight_ih" + sfx].buffer, g, bias, trans_b=True)
        else:
            be.gemm(xs, self.params["weight_ih" + sfx].buffer, g, trans_b=True)
        hs = self.workspace(ctx, "h", l, d, H)
        cs = self.workspace(ctx, "c", l, d, H) if self.cell_state else None
        init_h = self._sorted_state(ctx, h0, k, "h0")
        init_c = self._sorted_state(ctx, c0, k, "c0")
        be.recurrence_forward(self, ctx, Direction(sfx, l, d, g, hs, cs, init_h, init_c,
                                                   output=(layer_out, index, d * H)))
        last = ctx.workspace(("last", l, d), (order.num_sequences, H))
        for state, out in ((hs, outs[1]), (cs, outs[2] if cs is not None else None)):
            if state is not None:
                be.gather_rows(state, order.last_rows, last)
                be.scatter_rows(last, order.order, out, col=k * H)

    # ------------------------------------------------------------------ backward
    def backward(self, ctx):
        D, H, L = self.directions, self.hidden_size, self.num_layers
        grads = ctx.grad_outputs + [None]
        d_out, d_last, d_cell = grads[0], grads[1], grads[2] if self.cell_state else None
        n_in = len(ctx.inputs)
        h0_target = ctx.input_grad(1) if n_in > 1 else None
        c0_target = ctx.input_grad(2) if n_in > 2 else None
        for l in reversed(range(L)):
            layer_in = ctx.inputs[0] if l == 0 else self.workspace(ctx, "out", l - 1, 0, D * H)
            d_layer_out = d_out if l == L - 1 else self.workspace(ctx, "dout", l, 0, D * H)
            for d in range(D):
                if l == 0:
                    target = ctx.input_grad(0)
                    if target is not None and d == 1:
                        target.beta = 1.0  # the second direction adds to the first's
                else:
                    # between stacked layers: the first direction writes, the second adds
                    target = GradTarget(self.workspace(ctx, "dout", l - 1, 0, D * H), 0.0 if d == 0 else 1.0)
                self._backward_direction(ctx, l, d, layer_in, d_layer_out, target, d_last, d_cell,
                                         h0_target, c0_target)

    def _backward_direction(self, ctx, l, d, layer_in, d_layer_out, in_target, d_last, d_cell,
                            h0_target, c0_target):
        be, order, H = ctx.be, ctx.order, self.hidden_size
        sfx, k = self._suffix(l, d), l * self.directions + d
        n_seq = order.num_sequences
        index = order.index(self._reversed(d))
        xs, g, hs = (self.workspace(ctx, key, l, d, w) for key, w in
                     (("x", layer_in.shape[1]), ("g", self.gates * H), ("h", H)))
        cs = self.workspace(ctx, "c", l, d, H) if self.cell_state else None
        init_h = ctx.workspace(("h0", k), (n_seq, H)) if len(ctx.inputs) > 1 else None
        init_c = ctx.workspace(("c0", k), (n_seq, H)) if len(ctx.inputs) > 2 else None

        # gradients reaching each step's hidden (and cell) state from outside the recurrence
        dhs = self.workspace(ctx, "dh", l, d, H)
        if d_layer_out is not None:
            be.gather_rows(d_layer_out, index, dhs, col=d * H)
        else:
            be.fill(dhs, 0)
        dcs = self.workspace(ctx, "dc", l, d, H) if self.cell_state else None
        if dcs is not None:
            be.fill(dcs, 0)
        tmp = ctx.workspace(("dlast", l, d), (n_seq, H))
        for grad, target in ((d_last, dhs), (d_cell, dcs)):
            if grad is not None and target is not None:
                be.gather_rows(grad, order.order, tmp, col=k * H)
                be.scatter_rows(tmp, order.last_rows, target, beta=1.0)
        dh0 = ctx.workspace(("dh0", k), (n_seq, H)) if h0_target is not None else None
        dc0 = ctx.workspace(("dc0", k), (n_seq, H)) if c0_target is not None else None
        for a in (dh0, dc0):
            if a is not None:
                be.fill(a, 0)

        dg = self.workspace(ctx, "dg", l, d, self.gates * H)
        dgh = self.workspace(ctx, "dgh", l, d, self.gates * H) if self.separate_recurrent_bias else dg
        be.recurrence_backward(self, ctx, Direction(sfx, l, d, g, hs, cs, init_h, init_c, dhs=dhs, dcs=dcs, dg=dg,
                                                    dgh=dgh, dh0=dh0, dc0=dc0))
        self._weight_grads(ctx, sfx, l, d, layer_in, xs, hs, dg, dgh, init_h, in_target, index, h0_target, c0_target,
                           dh0, dc0)
        self._cell_grads(ctx, sfx, l, d, dg, cs, init_c)

    @staticmethod
    def _bias_grads(ctx, targets, key):
        """Each (gradient target, dG) pair's column sums; where both biases read the same dG (every
        cell but GRU's), the sums are taken once and added to each target."""
        targets = [(grad, src) for grad, src in targets if grad is not None]
        if len(targets) == 2 and targets[0][1] is targets[1][1]:
            sums = ctx.workspace(("bias sums", *key), (targets[0][1].shape[1],))
            ctx.be.bias_grad(targets[0][1], sums)
            for grad, _ in targets:
                ctx.be.axpby(1.0, sums, grad.beta, grad.array)
            return
        for grad, src in targets:
            ctx.be.bias_grad(src, grad.array, grad.beta)

    def _cell_grads(self, ctx, sfx, l, d, dg, cs, init_c):
        """The gradients of the cell's own parameters, over every step (none here)."""

    def _previous_states(self, ctx, l, d, key, states, init):
        """(each row's previous state, the first row that has one): rows of step 0 take the initial
        state, or have none where `init` is None."""
        order, n_seq = ctx.order, ctx.order.num_sequences
        total = int(order.step_starts[-1])
        previous = self.workspace(ctx, key, l, d, self.hidden_size)
        if init is not None:
            ctx.be.copy(init, previous[:n_seq])
        if total > n_seq:
            ctx.be.gather_rows(states, order.previous_rows, previous[n_seq:total])
        return previous, 0 if init is not None else n_seq

    def add_recurrent_grad(self, ctx, sfx, dgh, dprev_h):
        """dh_{t-1} += dG_t W_hh (the recurrent product's input gradient)."""
        self._weight_product(ctx, dgh, "weight_hh" + sfx, dprev_h, 1.0, transpose=False)

    def _recurrent_weight_grad(self, ctx, l, d, dgh, hprev, grad):
        """dW_hh = dGᵀ H_prev over the rows given (every step with a previous state)."""
        ctx.be.gemm_in(ctx.precision, dgh, hprev, grad.array, trans_a=True, beta=grad.beta)

    def _weight_grads(self, ctx, sfx, l, d, layer_in, xs, hs, dg, dgh, init_h, in_target, index, h0_target,
                      c0_target, dh0, dc0):
        """Weight and bias gradients, one GEMM each over every step, then the input gradient."""
        be, order, H = ctx.be, ctx.order, self.hidden_size
        total = int(order.step_starts[-1])
        k = l * self.directions + d
        grad = ctx.param_grad("weight_ih" + sfx)
        if grad is not None:
            be.gemm_in(ctx.precision, dg, xs, grad.array, trans_a=True, beta=grad.beta)
        grad = ctx.param_grad("weight_hh" + sfx)
        if grad is not None:
            hprev, first = self._previous_states(ctx, l, d, "hprev", hs, init_h)
            self._recurrent_weight_grad(ctx, l, d, dgh[first:total], hprev[first:total], grad)
        if self.has_bias:
            pairs = (("bias_ih", dg), ("bias_hh", dgh))
            self._bias_grads(ctx, [(ctx.param_grad(name + sfx), src) for name, src in pairs], (l, d))
        if in_target is not None:
            dxs = self.workspace(ctx, "dx", l, d, layer_in.shape[1])
            be.gemm_in(ctx.precision, dg, self.params["weight_ih" + sfx].buffer, dxs)
            be.scatter_rows(dxs, index, in_target.array, beta=in_target.beta)
        for target, sorted_grad in ((h0_target, dh0), (c0_target, dc0)):  # each (l, d) owns a column block
            if target is not None:
                be.scatter_rows(sorted_grad, order.order, target.array, beta=target.beta, col=k * H)


@register
class RNN(_Recurrent):
    """h_t = act(x_t W_ihᵀ + b_ih + h_{t-1} W_hhᵀ + b_hh), act tanh or relu."""

    kind = "rnn"
    separate_recurrent_bias = False

    @property
    def cell_name(self):
        return "rnn_" + self.nonlinearity

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, nonlinearity: str = "tanh",
                 bias: bool = True, bidirectional: bool = False, reverse: bool = False,
                 packed: Optional[bool] = None, name: Optional[str] = None) -> None:
        if nonlinearity not in ("tanh", "relu"):
            raise ValueError(f"RNN: nonlinearity must be 'tanh' or 'relu', found {nonlinearity!r}")
        self.nonlinearity = nonlinearity
        super().__init__(input_size, hidden_size, num_layers, bias, bidirectional, reverse, packed, name)

    def config(self):
        return {**super().config(), "nonlinearity": self.nonlinearity}

    def cell_forward(self, ctx, sfx, l, d, rows, g, prev_h, prev_c, h, c):
        if prev_h is not None:
            self._weight_product(ctx, prev_h, "weight_hh" + sfx, g, 1.0, transpose=True)
        ctx.be.activation(self.nonlinearity, g, h)

    def cell_backward(self, ctx, sfx, l, d, rows, g, prev_h, prev_c, h, c, dh, dc, dg, dgh, dprev_h, dprev_c):
        ctx.be.activation_backward(self.nonlinearity, h, dh, dg)


@register
class LSTM(_Recurrent):
    """i, f, g, o = σ, σ, tanh, σ of (x W_ihᵀ + b_ih + h W_hhᵀ + b_hh); c = f c + i g; h = o tanh(c).

    peepholes: the gates also read the cell, i and f the previous one and o the new one, each
    through its own vector (`weight_peephole<sfx>`, rows i, f, o): i = σ(… + p_i c_{t-1}),
    f = σ(… + p_f c_{t-1}), o = σ(… + p_o c_t) (ONNX's P, TensorFlow's use_peepholes). clip: every
    gate's pre-activation is clipped to [-clip, clip] before its activation (ONNX's clip, the
    gradient zero where clipped). Either runs the cell step by step from the backend's
    element-wise operations (the fused recurrence has neither)."""

    kind = "lstm"
    gates = 4
    cell_state = True
    separate_recurrent_bias = False

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 bidirectional: bool = False, reverse: bool = False, packed: Optional[bool] = None,
                 name: Optional[str] = None, peepholes: bool = False, clip: Optional[float] = None) -> None:
        super().__init__(input_size, hidden_size, num_layers, bias, bidirectional, reverse, packed, name)
        self.peepholes = bool(peepholes)
        self.clip = None if clip is None else float(clip)
        if self.clip is not None and not self.clip > 0:
            raise ValueError(f"LSTM: clip must be a positive threshold, found {clip!r}")
        if self.peepholes:
            rng, bound = generator(), 1 / math.sqrt(self.hidden_size)
            for l in range(self.num_layers):
                for d in range(self.directions):
                    self.add_param("weight_peephole" + self._suffix(l, d), uniform(rng, bound, (3, self.hidden_size)))

    def config(self):
        extra = {"peepholes": True} if self.peepholes else {}
        return {**super().config(), **extra, **({"clip": self.clip} if self.clip is not None else {})}

    @property
    def cell_name(self):
        return "lstm" if not (self.peepholes or self.clip is not None) else "lstm_extended"

    def cell_forward(self, ctx, sfx, l, d, rows, g, prev_h, prev_c, h, c):
        if prev_h is not None:
            self._weight_product(ctx, prev_h, "weight_hh" + sfx, g, 1.0, transpose=True)
        if self.cell_name == "lstm":
            return ctx.be.lstm_step(g, prev_c, c, h)
        be, H, n = ctx.be, self.hidden_size, g.shape[0]
        pre = self.workspace(ctx, "pre", l, d, 4 * H)[rows]  # each gate's pre-activation, for backward
        if self.peepholes and prev_c is not None:
            for gate in (0, 1):  # i and f read c_{t-1}
                self._add_peephole(ctx, sfx, gate, prev_c, g, gate * H)
        be.copy(g, pre)
        self._clip(ctx, g)
        # lstm_step activates i, f and g and makes c; o (which reads c_t) and h are made again below
        be.lstm_step(g, prev_c, c, h)
        o, t = self._scratch(ctx, "o", n), self._scratch(ctx, "t", n)
        be.copy_from_columns(pre, 3 * H, o)
        if self.peepholes:
            self._add_peephole(ctx, sfx, 2, c, o, None)
            be.copy_to_columns(o, pre, 3 * H)
        self._clip(ctx, o)
        be.activation("sigmoid", o, o)
        be.copy_to_columns(o, g, 3 * H)
        be.activation("tanh", c, t)
        be.multiply(o, t, h)

    def cell_backward(self, ctx, sfx, l, d, rows, g, prev_h, prev_c, h, c, dh, dc, dg, dgh, dprev_h, dprev_c):
        if self.cell_name == "lstm":
            return ctx.be.lstm_step_backward(g, prev_c, c, dh, dc, dg, dprev_c)
        be, H, n = ctx.be, self.hidden_size, g.shape[0]
        pre = self.workspace(ctx, "pre", l, d, 4 * H)[rows]
        clipped = self._past_clip(ctx, pre) if self.clip is not None else None
        if self.peepholes:  # o read c_t: its pre-activation's gradient reaches c_t through p_o
            o, t, do = self._scratch(ctx, "o", n), self._scratch(ctx, "t", n), self._scratch(ctx, "do", n)
            be.copy_from_columns(g, 3 * H, o)
            be.activation("tanh", c, t)
            be.multiply(dh, t, t)
            be.activation_backward("sigmoid", o, t, do)
            if clipped is not None:
                be.copy_from_columns(clipped, 3 * H, t)
                be.select(t, self._row(ctx, 0.0, H), do, do)
            self._add_peephole(ctx, sfx, 2, do, dc, None)
        be.lstm_step_backward(g, prev_c, c, dh, dc, dg, dprev_c)
        if clipped is not None:  # no gradient where a pre-activation was clipped
            be.select(clipped, self._row(ctx, 0.0, 4 * H), dg, dg)
        if self.peepholes and dprev_c is not None:
            di = self._scratch(ctx, "do", n)
            for gate in (0, 1):  # c_{t-1} reached i and f through p_i and p_f
                be.copy_from_columns(dg, gate * H, di)
                self._add_peephole(ctx, sfx, gate, di, dprev_c, None)

    def _cell_grads(self, ctx, sfx, l, d, dg, cs, init_c):
        """dp_i = Σ dG_i c_{t-1} and dp_f = Σ dG_f c_{t-1} over the rows with a previous cell,
        dp_o = Σ dG_o c_t over every row."""
        grad = ctx.param_grad("weight_peephole" + sfx) if self.peepholes else None
        if grad is None:
            return
        be, H, total = ctx.be, self.hidden_size, int(ctx.order.step_starts[-1])
        cprev, first = self._previous_states(ctx, l, d, "cprev", cs, init_c)
        part, product = self.workspace(ctx, "dpart", l, d, H), self.workspace(ctx, "dproduct", l, d, H)
        for row, gate, cells, start in ((0, 0, cprev, first), (1, 1, cprev, first), (2, 3, cs, 0)):
            be.copy_from_columns(dg, gate * H, part)
            be.multiply(part[start:total], cells[start:total], product[start:total])
            be.bias_grad(product[start:total], grad.array[row], grad.beta)

    # the pieces of the extended cell, from the backend's element-wise operations
    def _scratch(self, ctx, key, rows):
        return ctx.workspace(("lstm", key), (ctx.order.num_sequences, self.hidden_size))[:rows]

    def _row(self, ctx, value, width):
        """A row of `width` values equal to `value` (select reads one row for every row)."""
        row = ctx.workspace(("lstm row", value, width), (width,))
        ctx.be.fill(row, value)
        return row

    def _add_peephole(self, ctx, sfx, k, x, out, col):
        """out (its columns col.., or all of it where col is None) += p_k x, p_k row k of the
        direction's peephole weights spread over x's rows."""
        be, n = ctx.be, x.shape[0]
        spread, product = self._scratch(ctx, "spread", n), self._scratch(ctx, "product", n)
        ones = be.ones(x.size, x.dtype).reshape(x.shape)
        be.select(ones, self.params["weight_peephole" + sfx].buffer[k], x, spread)
        be.multiply(spread, x, product)
        if col is None:
            be.axpby(1.0, product.reshape(-1), 1.0, out.reshape(-1))
        else:
            be.copy_to_columns(product, out, col, beta=1.0)

    def _over(self, ctx, x):
        """A scratch of x's shape for the clip's comparisons."""
        width = x.shape[1]
        return ctx.workspace(("lstm clip", width), (ctx.order.num_sequences, width))[:x.shape[0]]

    def _clip(self, ctx, x):
        """x clipped to [-clip, clip] in place (NaN stays NaN)."""
        if self.clip is None:
            return
        be, width, over = ctx.be, x.shape[1], self._over(ctx, x)
        for sign in (1.0, -1.0):  # over = sign x - clip: positive past the bound on that side
            be.axpby(sign, x.reshape(-1), 0.0, over.reshape(-1))
            be.add_bias(over, self._row(ctx, -self.clip, width))
            be.select(over, self._row(ctx, sign * self.clip, width), x, x)

    def _past_clip(self, ctx, pre):
        """|pre| - clip: positive where a pre-activation was clipped."""
        past = self._over(ctx, pre)
        ctx.be.activation("abs", pre, past)
        ctx.be.add_bias(past, self._row(ctx, -self.clip, pre.shape[1]))
        return past


@register
class GRU(_Recurrent):
    """r, z = σ(x W_i{r,z}ᵀ + b + h W_h{r,z}ᵀ + b); n = tanh(x W_inᵀ + b_in + r (h W_hnᵀ + b_hn));
    h' = (1 - z) n + z h.

    linear_before_reset=False takes the other form (ONNX's default, Keras's reset_after=False):
    n = tanh(x W_inᵀ + b_in + (r h) W_hnᵀ + b_hn), the reset gate applied to the state before
    the product. That form needs r before the candidate's recurrent product, so each step runs
    two GEMMs (W_h{r,z}, then W_hn on r h) and the steps one at a time (no fused recurrence)."""

    kind = "gru"
    gates = 3
    separate_recurrent_bias = True  # b_hh sits inside r * (...), so it cannot join b_ih

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 bidirectional: bool = False, reverse: bool = False, packed: Optional[bool] = None,
                 linear_before_reset: bool = True, name: Optional[str] = None) -> None:
        self.linear_before_reset = bool(linear_before_reset)
        super().__init__(input_size, hidden_size, num_layers, bias, bidirectional, reverse, packed, name)

    def config(self):
        return {**super().config(), "linear_before_reset": self.linear_before_reset}

    @property
    def cell_name(self):
        return "gru" if self.linear_before_reset else "gru_reset_first"

    def uses_packed(self, be):
        # the reset-first form multiplies by blocks of W_hh's rows: plain GEMMs on the weight itself
        return self.linear_before_reset and super().uses_packed(be)

    def _blocks(self, sfx):
        """W_hh's rows for r and z, and for n."""
        w, H = self.params["weight_hh" + sfx].buffer, self.hidden_size
        return w[:2 * H], w[2 * H:]

    def _scratch(self, ctx, key, l, d, rows):
        return ctx.workspace(("gru", key, l, d), (ctx.order.num_sequences, self.hidden_size))[:rows]

    def cell_forward(self, ctx, sfx, l, d, rows, g, prev_h, prev_c, h, c):
        if not self.linear_before_reset:
            return self._reset_first_forward(ctx, sfx, l, d, rows, g, prev_h, h)
        be = ctx.be
        hh = self.workspace(ctx, "hh", l, d, 3 * self.hidden_size)[rows]
        if prev_h is not None:
            self._weight_product(ctx, prev_h, "weight_hh" + sfx, hh, 0.0, transpose=True)
        else:
            be.fill(hh, 0)
        if self.has_bias:
            be.add_bias(hh, self.params["bias_hh" + sfx].buffer)
        be.gru_step(g, hh, prev_h, h)

    def cell_backward(self, ctx, sfx, l, d, rows, g, prev_h, prev_c, h, c, dh, dc, dg, dgh, dprev_h, dprev_c):
        hh = self.workspace(ctx, "hh", l, d, 3 * self.hidden_size)[rows]
        ctx.be.gru_step_backward(g, hh, prev_h, dh, dg, dgh, dprev_h)
        if not self.linear_before_reset:
            self._reset_first_backward(ctx, sfx, l, d, rows, g, prev_h, dg, dgh, dprev_h)

    # The reset-first form through the same cell kernels: the candidate's recurrent part
    # (r h) W_hnᵀ + b_hn is added into G's n block, and the n block of hh is zero, so gru_step's
    # tanh(G_n + r · hh_n) is the right candidate, and gru_step_backward gives dz, dn and the
    # direct path into h_{t-1}; the reset gate's gradient and the products' gradients follow here.
    def _reset_first_forward(self, ctx, sfx, l, d, rows, g, prev_h, h):
        be, H = ctx.be, self.hidden_size
        n = g.shape[0]
        w_rz, w_n = self._blocks(sfx)
        b_hh = self.params["bias_hh" + sfx].buffer if self.has_bias else None
        hh = self.workspace(ctx, "hh", l, d, 3 * H)[rows]
        r, part = self._scratch(ctx, "r", l, d, n), self._scratch(ctx, "part", l, d, n)
        rh = self.workspace(ctx, "rh", l, d, H)[rows]  # r h_{t-1}, kept for dW_hn
        be.fill(hh, 0)
        if prev_h is not None:
            be.gemm(prev_h, w_rz, hh[:, :2 * H], trans_b=True)
        if b_hh is not None:
            be.add_bias(hh, b_hh)
        be.copy_from_columns(g, 0, r)
        be.copy_from_columns(hh, 0, r, beta=1.0)
        be.activation("sigmoid", r, r)
        if prev_h is not None:
            be.multiply(r, prev_h, rh)
            be.gemm(rh, w_n, part, trans_b=True)
        else:
            be.fill(rh, 0)
            be.fill(part, 0)
        be.copy_from_columns(hh, 2 * H, part, beta=1.0)  # + b_hn
        be.copy_to_columns(part, g, 2 * H, beta=1.0)
        be.fill(part, 0)
        be.copy_to_columns(part, hh, 2 * H)
        be.gru_step(g, hh, prev_h, h)

    def _reset_first_backward(self, ctx, sfx, l, d, rows, g, prev_h, dg, dgh, dprev_h):
        """After gru_step_backward with hh_n = 0: dG holds [0, dz, dn] and dh_{t-1} has z dh.
        Here: dGh_n = dn (for dW_hn and db_hn), t = dn W_hn, dr = σ'(r) · t h_{t-1} (into both dG
        and dGh), dh_{t-1} += r t + dGh_{r,z} W_h{r,z}."""
        be, H = ctx.be, self.hidden_size
        n = g.shape[0]
        w_rz, w_n = self._blocks(sfx)
        dn, t = self._scratch(ctx, "r", l, d, n), self._scratch(ctx, "part", l, d, n)
        be.copy_from_columns(dg, 2 * H, dn)
        be.copy_to_columns(dn, dgh, 2 * H)
        if prev_h is None:  # no previous state: the reset gate had nothing to scale
            return
        be.gemm(dn, w_n, t)
        r, u = dn, self._scratch(ctx, "u", l, d, n)  # (dn is no longer needed)
        be.copy_from_columns(g, 0, r)
        be.multiply(t, prev_h, u)
        dr = self._scratch(ctx, "dr", l, d, n)
        be.activation_backward("sigmoid", r, u, dr)
        be.copy_to_columns(dr, dg, 0)
        be.copy_to_columns(dr, dgh, 0)
        if dprev_h is not None:
            be.multiply(t, r, dprev_h, beta=1.0)
            be.gemm(dgh[:, :2 * H], w_rz, dprev_h, beta=1.0)

    def add_recurrent_grad(self, ctx, sfx, dgh, dprev_h):
        if self.linear_before_reset:
            super().add_recurrent_grad(ctx, sfx, dgh, dprev_h)
        # (the reset-first form added its part in cell_backward)

    def _recurrent_weight_grad(self, ctx, l, d, dgh, hprev, grad):
        if self.linear_before_reset:
            return super()._recurrent_weight_grad(ctx, l, d, dgh, hprev, grad)
        be, H = ctx.be, self.hidden_size
        total = int(ctx.order.step_starts[-1])
        rh = self.workspace(ctx, "rh", l, d, H)[total - hprev.shape[0]:total]  # the same rows as hprev
        be.gemm(dgh[:, :2 * H], hprev, grad.array[:2 * H], trans_a=True, beta=grad.beta)
        be.gemm(dgh[:, 2 * H:], rh, grad.array[2 * H:], trans_a=True, beta=grad.beta)
