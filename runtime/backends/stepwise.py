"""The recurrence of one layer direction over a batch order, step by step: the algorithm every
backend has. Each step is the layer's cell (lamina.layers.recurrent: a recurrent GEMM over the
running sequences and a cell kernel); the rows of step t are the sequences longer than t and the
first rows of step t-1 hold their previous states (lamina.sequence.BatchOrder). A backend with a
faster whole-recurrence kernel (the CPU's fused recurrence, backends/cpu/fused_recurrence.py)
overrides the Backend methods that call these.
"""
from dataclasses import dataclass
from typing import Optional

import numpy as np


@dataclass
class Direction:
    """One layer direction's buffers, rows in batch order (time-major)."""
    sfx: str  # the parameters' suffix (_l0, _l0_reverse, ...)
    l: int  # the layer
    d: int  # the direction
    g: np.ndarray  # [rows, gates·H]: x W_ihᵀ (+ the input bias) in, the activated gates out
    hs: np.ndarray  # [rows, H]: every step's hidden state
    cs: Optional[np.ndarray] = None  # [rows, H]: every step's cell state (LSTM)
    init_h: Optional[np.ndarray] = None  # [sequences, H]: initial states in sorted order, or None for zeros
    init_c: Optional[np.ndarray] = None
    output: Optional[tuple] = None  # forward: (out, rows, col): the states also go to out[rows[r], col:col + H]
    dhs: Optional[np.ndarray] = None  # backward: gradients reaching each step's states from outside
    dcs: Optional[np.ndarray] = None
    dg: Optional[np.ndarray] = None  # backward: the gates' pre-activation gradients
    dgh: Optional[np.ndarray] = None  # backward: those of the recurrent product (dg unless b_hh is apart)
    dh0: Optional[np.ndarray] = None  # backward: the initial states' gradients, or None
    dc0: Optional[np.ndarray] = None


def _rows(a, rows):
    return a[rows] if a is not None else None


def step_rows(order, t):
    """(the rows of step t, the rows of their previous states: in the initial states at step 0,
    else in the step before)."""
    r0, b = order.step(t)
    p0 = 0 if t == 0 else int(order.step_starts[t - 1])
    return slice(r0, r0 + b), slice(p0, p0 + b)


def forward_step(cell, ctx, run, rows, prev, first):
    """The cell over `rows` from the states at `prev` (in the initial states where `first`). rows
    and prev index the layer's buffers: slices of one step, or a backend's blocks of many."""
    prev_h, prev_c = (_rows(run.init_h, prev), _rows(run.init_c, prev)) if first else \
        (run.hs[prev], _rows(run.cs, prev))
    cell.cell_forward(ctx, run.sfx, run.l, run.d, rows, run.g[rows], prev_h, prev_c, run.hs[rows],
                      _rows(run.cs, rows))


def backward_step(cell, ctx, run, rows, prev, first):
    """dg and dgh of `rows` (as forward_step), then dh_{t-1} += dG_t W_hh."""
    if first:
        prev_h, prev_c = _rows(run.init_h, prev), _rows(run.init_c, prev)
        dprev_h = _rows(run.dh0, prev) if prev_h is not None else None
        dprev_c = _rows(run.dc0, prev)
    else:
        prev_h, dprev_h = run.hs[prev], run.dhs[prev]
        prev_c, dprev_c = _rows(run.cs, prev), _rows(run.dcs, prev)
    cell.cell_backward(ctx, run.sfx, run.l, run.d, rows, run.g[rows], prev_h, prev_c, run.hs[rows],
                       _rows(run.cs, rows), run.dhs[rows], _rows(run.dcs, rows), run.dg[rows], run.dgh[rows],
                       dprev_h, dprev_c)
    if dprev_h is not None:
        cell.add_recurrent_grad(ctx, run.sfx, run.dgh[rows], dprev_h)


def store_output(ctx, run):
    """Every step's states into run.output."""
    out, index, col = run.output
    ctx.be.scatter_rows(run.hs, index, out, col=col)


def forward(cell, ctx, run):
    for t in range(ctx.order.steps):
        forward_step(cell, ctx, run, *step_rows(ctx.order, t), t == 0)
    store_output(ctx, run)


def backward(cell, ctx, run):
    """dg and dgh of every step, walking back."""
    for t in reversed(range(ctx.order.steps)):
        backward_step(cell, ctx, run, *step_rows(ctx.order, t), t == 0)
