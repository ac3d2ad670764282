"""The CPU's pointwise convolution (kernel 1, stride 1, no padding, one group): y = act(W x + b)
per sample, W [out, in] times the sample's input [in, positions] as panel tiles read from the
input itself, each tile stored with its bias and ReLU (or ReLU capped, as ReLU6) applied, so y is
written once. Two kernels (pyx/panels_impl.h):
- by panels of positions (pointwise_conv): tiles of 6 output channels x 16 positions, W's rows
  broadcast in place and the input's rows read as the panels;
- by tiles of positions (pointwise_positions): tiles of 6 positions x 16 output channels, the
  panels of Wᵀ packed once (kept until W changes, as a Linear's pack is) and the input read as
  its transpose, each tile stored transposed; for samples of few positions, which fill panels of
  16 poorly, and deep inputs, whose rows of W broadcast from far apart.
The column path ran the same product as an OpenBLAS GEMM into y preset to the bias and then an
activation pass: three passes over y."""
import math

from .compiled import _kernels
from .. import columns
from ...threads import free_threads, split_work

# A sample runs by panels of positions with at least this many positions and at most this many
# input channels, else by tiles of positions. One layer with ReLU6 at batch 1, AMD EPYC (Zen 3),
# ms, by tiles / by panels / OpenBLAS (the column path), 1 thread: 384 -> 64 at 14² 0.089 / 0.097
# / 0.113, 576 -> 96 at 14² 0.201 / 0.219 / 0.231, 960 -> 320 at 7² 0.329 / 0.421 / 0.350, 160 ->
# 960 at 7² 0.165 / 0.183 / 0.185, 320 -> 1280 at 7² 0.456 / 0.550 / 0.465, but 96 -> 576 at 14²
# 0.233 / 0.211 / 0.243 and 64 -> 384 at 14² 0.114 / 0.096 / 0.118; 2 threads: 960 -> 320 at 7²
# 0.170 / 0.323 / 0.187, 576 -> 96 at 14² 0.106 / 0.123 / 0.133, 64 -> 384 at 14² 0.058 / 0.056 /
# 0.072.
POSITIONS_MIN_PANELS = 64
PANELS_MAX_DEPTH = 256


def applies(geom):
    """Kernel 1, stride 1, no padding (the input is the column matrix), one group."""
    return (not geom.transposed and geom.groups == 1 and max(geom.kernel_size + geom.stride) == 1
            and max(geom.padding + geom.padding_end) == 0)


def by_positions(geom, positions):
    """Whether a sample of `positions` positions runs by tiles of positions (the panels of W
    packed once) rather than by panels of its positions read in place: where the sample has too
    few positions to fill panels of 16, or W's rows are too deep to broadcast from in place."""
    return positions < POSITIONS_MIN_PANELS or geom.in_channels > PANELS_MAX_DEPTH


def forward(geom, weight, ctx, bias=None, relu=False, cap=math.inf):
    """y = conv(x) + bias, through a ReLU capped at `cap` where relu is set."""
    be, x, y = ctx.be, ctx.inputs[0], ctx.output
    n, positions = x.shape[0], math.prod(x.shape[2:])
    act = 0 if not relu else 1 if cap == math.inf else 2
    cap = cap if act == 2 else 0.0
    xs, ys = x.reshape(n, geom.in_channels, positions), y.reshape(n, geom.out_channels, positions)
    if by_positions(geom, positions):
        panels = ctx.layer.packed_weight(be, weight, True, 1, method="pack_panels").panels

        def sample(i, team):
            _kernels.pointwise_positions(panels, xs[i], ys[i], bias, act, cap, team)
    else:
        w = weight.buffer.reshape(geom.out_channels, geom.in_channels)

        def sample(i, team):
            _kernels.pointwise_conv(w, xs[i], ys[i], bias, act, cap, team)
    if n == 1:  # a lone sample's product shared by the team
        sample(0, free_threads())
    else:
        split_work(n, lambda t, items: [sample(i, 1) for i in items], columns.threads(ctx))
