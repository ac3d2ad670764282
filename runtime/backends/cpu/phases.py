"""The CPU's strided transposed convolution as stride-1 sub-convolutions, one per output phase
(sub-pixel decomposition), forward: no column matrix of k³ rows and no scatter-add.

Along one axis (stride s, kernel k, padding p before), output o = i·s - p + a takes input i
through tap a. The outputs of phase r (0 <= r < s) are o = m·s + r - p; the taps that reach
them are a = r + s·j, j < J_r = ceil((k - r) / s), from inputs i = m - j. So phase r is a
stride-1 convolution of x with those J_r taps in reverse order, its output m reading the window
of inputs m - J_r + 1 .. m: the direct kernel (direct_conv.h) on one zero-padded copy of the
sample, one call per phase of every axis, into a scratch that a strided copy places into y.
Every output is written once; a phase no tap reaches (k < s) is zero. Dilation 1 only.
"""
import itertools
import math

import numpy as np

from .compiled import _kernels
from ...threads import split_work
from .. import columns
from ..columns import as_volume
from .direct import ROW_SLACK, _layout


def applies(geom):
    """A transposed convolution with a stride above 1, no dilation, the same padding on both
    sides of every axis."""
    return (geom.transposed and max(geom.stride) > 1 and max(geom.dilation) == 1 and geom.symmetric)


def _geometry(geom):
    """The 3-D (kernel, stride, padding) of the layer (a 2-D one has depth 1)."""
    kernel, stride, padding, _, _ = geom.windows
    return kernel, stride, padding


def _phase_taps(k, s, r):
    """Taps a = r + s·j of phase r, in the order the phase's convolution reads them (j falling)."""
    return list(range(r, k, s))[::-1]


def _pack_phase(geom, weight, phase):
    """The weight's taps of one phase (r_d, r_h, r_w) as a convolution weight [groups, out_g,
    in_g, taps] packed for direct_conv.h (cached per weight version)."""
    kernel, stride, _ = _geometry(geom)
    out_g, in_g = geom.out_channels // geom.groups, geom.in_channels // geom.groups
    taps = [_phase_taps(k, s, r) for k, s, r in zip(kernel, stride, phase)]

    def build(buffer):
        w = buffer.reshape((geom.groups, in_g, out_g) + kernel)  # transposed: [in, out_g, *k]
        w = w[:, :, :, taps[0]][:, :, :, :, taps[1]][..., taps[2]]
        return _layout(np.ascontiguousarray(w.transpose(0, 2, 1, 3, 4, 5)).reshape(geom.groups, out_g, in_g, -1))
    return weight.derived(("phase", phase), build)


def _phase_plan(geom, out_sizes):
    """Per phase with outputs and taps: (phase, tap counts, first m, counts of m, first output),
    all per axis."""
    kernel, stride, padding = _geometry(geom)
    plans = []
    for phase in itertools.product(*(range(s) for s in stride)):
        counts, m_lo, m_n, o_lo = [], [], [], []
        for k, s, p, r, size in zip(kernel, stride, padding, phase, out_sizes):
            c = r - p  # output o = m·s + c
            lo = max(0, -(c // s))  # the first m with o >= 0
            hi = -(-(size - c) // s)  # past the last m with o < size
            counts.append(len(_phase_taps(k, s, r)))
            m_lo.append(lo)
            m_n.append(max(0, hi - lo))
            o_lo.append(lo * s + c)
        if min(m_n) > 0:
            plans.append((phase, tuple(counts), tuple(m_lo), tuple(m_n), tuple(o_lo)))
    return plans


def forward(geom, weight, ctx):
    """y = the transposed convolution of x, phase by phase (without the bias)."""
    x, y = ctx.inputs[0], ctx.output
    kernel, step, _ = _geometry(geom)
    c, d, h, w = as_volume(x[0]).shape
    plans = _phase_plan(geom, as_volume(y[0]).shape[1:])
    # one zero padding serves every phase, the most taps any phase has (J) on both sides: a
    # phase's first window starts up to J - 1 before its first input, its last may end one past
    # the input
    pad = tuple(max(-(-k // s), 1) for k, s in zip(kernel, step))
    padded = (c, d + 2 * pad[0], h + 2 * pad[1], w + 2 * pad[2] + ROW_SLACK)
    packs = {plan[0]: _pack_phase(geom, weight, plan[0]) for plan in plans if min(plan[1]) > 0}
    largest = max((math.prod(plan[3]) for plan in plans), default=0)

    def work(t, samples):
        xp = ctx.workspace(("phase input", t), padded)
        scratch = ctx.workspace(("phase output", t), (geom.out_channels * largest,))
        for n in samples:
            yn = as_volume(y[n])
            _kernels.padded_copy(as_volume(x[n]), xp, *pad)
            for phase, counts, m_lo, m_n, o_lo in plans:
                target = yn[:, o_lo[0]::step[0], o_lo[1]::step[1], o_lo[2]::step[2]][:, :m_n[0], :m_n[1], :m_n[2]]
                if min(counts) == 0:  # no tap reaches these outputs
                    target[...] = 0
                    continue
                out = scratch[:geom.out_channels * math.prod(m_n)].reshape((geom.out_channels,) + m_n)
                origin = [lo - j + 1 + p for lo, j, p in zip(m_lo, counts, pad)]
                _kernels.direct_conv_padded(xp, packs[phase], out, geom.groups, *counts, 1, 1, 1, 1, 1, *origin)
                target[...] = out
    split_work(x.shape[0], work, columns.threads(ctx))
