"""The CPU's pointwise convolution (kernel 1, stride 1, no padding, one group): y = act(W x + b)
per sample, W [out, in] times the sample's input [in, positions] as panel tiles read from the
input itself, each tile stored with its bias and ReLU (or ReLU capped, as ReLU6) applied, so y is
written once. Two kernels (pyx/panels_impl.h):
- by panels of positions (pointwise_conv): tiles of 6 output channels (8 in the AVX-512 build) x
  16 positions, W's rows broadcast in place and the input's rows read as the panels;
- by tiles of positions (pointwise_positions): tiles of 6 positions (8) x 16 output channels, the
  panels of Wᵀ packed once (kept until W changes, as a Linear's pack is) and the input read as
  its transpose, each tile stored transposed; for samples of few positions, which fill panels of
  16 poorly, and deep inputs, whose rows of W broadcast from far apart.
The column path ran the same product as an OpenBLAS GEMM into y preset to the bias and then an
activation pass: three passes over y. Its blocks of a column matrix (any one-group convolution
the column algorithm runs) now take the same kernels (columns_forward)."""
import math

from .compiled import _kernels
from .. import columns
from ...threads import free_threads, split_work

# A product of W [out, depth] and [depth, positions] runs by panels of positions with at least
# POSITIONS_MIN_PANELS positions and at most PANELS_MAX_DEPTH input channels; else by tiles of
# positions where x and one panel of W fit in POSITIONS_MAX_BYTES (the L2 cache of the machines
# measured, 512 KiB a core: each panel passes over all of x); else as a GEMM. One layer with ReLU6
# at batch 1, AMD EPYC (Zen 4, the AVX-512 build), ms, by tiles / by panels / OpenBLAS (with a
# pass for the activation), 1 thread: 384 -> 64 at 14² 0.089 / 0.097 / 0.113, 576 -> 96 at 14²
# 0.201 / 0.219 / 0.231, 960 -> 320 at 7² 0.329 / 0.421 / 0.350, 160 -> 960 at 7² 0.165 / 0.183 /
# 0.185, 320 -> 1280 at 7² 0.456 / 0.550 / 0.465, but 96 -> 576 at 14² 0.233 / 0.211 / 0.243 and
# 64 -> 384 at 14² 0.114 / 0.096 / 0.118; 2 threads: 960 -> 320 at 7² 0.170 / 0.323 / 0.187, 576
# -> 96 at 14² 0.106 / 0.123 / 0.133, 64 -> 384 at 14² 0.058 / 0.056 / 0.072. Past the L2 cache,
# ResNet-18's strided 3x3 layers at batch 1 (their column matrices, GEMM's time over the tiles',
# in one process): 2304 deep x 49 0.97x, 576 x 784 0.96x, 1152 x 196 0.99-1.09x.
POSITIONS_MIN_PANELS = 64
PANELS_MAX_DEPTH = 256
POSITIONS_MAX_BYTES = 512 << 10
# In a bfloat16 run a pointwise or column product at least BF16_MIN_DEPTH deep multiplies in
# bfloat16; on lamina's panels of W (tiles of positions stored transposed) for samples of at most
# BF16_PANELS_MAX_POSITIONS output positions, else as GEMMs in bfloat16 (the input's panels made
# per product). One layer in float32 over each, AMD EPYC (Zen 4, AVX512-BF16), 2 threads, batch
# 1 / 16, bfloat16 GEMMs / W's panels: 320 -> 1280 at 7² 1.40x / 1.89x, 1.32x / 1.69x; 1280 -> 320
# at 7² 1.11x / 1.61x, 1.31x / 1.74x; 256 -> 256 at 14² 1.06x / 1.31x, 1.16x / 1.00x; 192 -> 192
# at 28² 1.21x / 1.18x, 1.28x / 0.93x; 3x3 stride 2 128 -> 256 at 28² 1.41x / 1.49x, 1.52x /
# 1.54x, 64 -> 128 at 56² 1.30x / 1.04x, 1.45x / 1.30x; but 96 -> 576 at 14² 1.01x / 1.21x,
# 0.91x / 0.92x, 64 -> 384 at 14² 0.97x / 1.07x, 0.74x / 0.68x and 32 -> 192 at 56² 0.81x / 0.81x,
# 0.97x / 0.84x (the products of a shallow depth stream their operands from memory either way).
BF16_MIN_DEPTH = 128
BF16_PANELS_MAX_POSITIONS = 256


def applies(geom):
    """Kernel 1, stride 1, no padding (the input is the column matrix), one group."""
    return (not geom.transposed and geom.groups == 1 and max(geom.kernel_size + geom.stride) == 1
            and max(geom.padding + geom.padding_end) == 0)


def kernel(depth, positions, itemsize):
    """The pointwise kernel for a product of W [out, depth] and x [depth, positions] of values of
    `itemsize` bytes: 'panels' (by panels of positions, x read in place), 'positions' (by tiles
    of positions, W's panels packed once), or None (neither: a GEMM)."""
    if depth <= PANELS_MAX_DEPTH and positions >= POSITIONS_MIN_PANELS:
        return "panels"
    if depth * (positions * itemsize + 64) <= POSITIONS_MAX_BYTES:
        return "positions"
    return None


def product(weight, ctx, depth, bias=None, relu=False, cap=math.inf):
    """run(x, y, team): y = act(W x + bias) for W the weight as a matrix [out, depth], x [depth,
    positions] and y [out, positions] (blocks of columns of larger matrices allowed), on a team
    of up to `team` threads: by panels of positions where `kernel` says so, else by tiles of
    positions (the caller asks `kernel` whether either applies)."""
    act, cap = _activation_code(relu, cap)
    w = weight.buffer.reshape(-1, depth)

    def run(x, y, team=1):
        if kernel(depth, x.shape[1], x.dtype.itemsize) == "panels":
            _kernels.pointwise_conv(w, x, y, bias, act, cap, team)
        else:
            panels = ctx.layer.packed_weight(ctx.be, weight, True, 1, method="pack_panels").panels
            _kernels.pointwise_positions(panels, x, y, bias, act, cap, team)
    return run


def _activation_code(relu, cap):
    """(act, cap) as the kernels take them: act 0 none, 1 ReLU, 2 ReLU capped at cap (0 unless 2)."""
    act = 0 if not relu else 1 if cap == math.inf else 2
    return act, cap if act == 2 else 0.0


def bf16_product(weight, ctx, depth, bias=None, relu=False, cap=math.inf):
    """run(x, y, team) as product's, in bfloat16 (a bfloat16 run where the backend multiplies on
    lamina's bfloat16 panels): W's bfloat16 panels, packed once as a Linear's weight (until W
    changes), times x's columns rounded where they lie, each tile of positions x channels stored
    transposed into y with its bias and activation (CPUBackend.bf16_positions)."""
    act, cap = _activation_code(relu, cap)
    packed = ctx.layer.packed_weight(ctx.be, weight, True, 1, "bfloat16")  # (once a forward, not per sample)

    def run(x, y, team=1):
        ctx.be.bf16_positions(x, packed, y, bias, act, cap, team)
    return run


def _on_columns(geom, weight, ctx, bias, relu, cap):
    """The column algorithm's GEMMs into y preset to the bias, then the activation's pass."""
    activation = None if not relu else ("relu", 0.0) if cap == math.inf else ("bounded_relu", cap)
    columns.any_forward(geom, weight, ctx, bias, activation)


def forward(geom, weight, ctx, bias=None, relu=False, cap=math.inf):
    """y = conv(x) + bias, through a ReLU capped at `cap` where relu is set."""
    x = ctx.inputs[0]
    if kernel(geom.in_channels, math.prod(x.shape[2:]), x.dtype.itemsize) is None:
        return _on_columns(geom, weight, ctx, bias, relu, cap)
    _by_samples(geom, ctx, product(weight, ctx, geom.in_channels, bias, relu, cap))


def _by_samples(geom, ctx, run):
    """run(x_n, y_n, team) for each sample as matrices [channels, positions]: a lone sample's
    product shared by the team, else the samples shared between threads."""
    x, y = ctx.inputs[0], ctx.output
    n, positions = x.shape[0], math.prod(x.shape[2:])
    xs, ys = x.reshape(n, geom.in_channels, positions), y.reshape(n, geom.out_channels, positions)
    if n == 1:
        run(xs[0], ys[0], free_threads())
    else:
        split_work(n, lambda t, items: [run(xs[i], ys[i]) for i in items], columns.threads(ctx))


def columns_forward(geom, weight, ctx, bias=None, relu=False, cap=math.inf):
    """The column algorithm's forward (vol2col by blocks, columns.forward), each block's product
    on the pointwise kernels with the block's column matrix as their input, so each output is
    stored once with its bias and activation: one group, not transposed, where a kernel applies
    to the largest block; else the column algorithm's GEMMs (_on_columns)."""
    depth = geom.in_channels * math.prod(geom.kernel_size)
    grid = geom.windows[4]
    largest = max((r1 - r0) * grid[-1] for r0, r1 in columns.block_ranges(depth, grid))
    if (geom.transposed or geom.groups > 1 or geom.pointwise
            or kernel(depth, largest, ctx.output.dtype.itemsize) is None):
        return _on_columns(geom, weight, ctx, bias, relu, cap)
    columns.forward(geom, weight, ctx, product=product(weight, ctx, depth, bias, relu, cap))


def bfloat16_forward(geom, weight, ctx, bias=None, activation=None):
    """The pointwise or column algorithm's forward in a bfloat16 run. A product at least
    BF16_MIN_DEPTH deep multiplies in bfloat16: for one group, not transposed, with at most
    BF16_PANELS_MAX_POSITIONS output positions a sample, where the backend multiplies on
    lamina's bfloat16 panels, W's panels times the input (pointwise) or each block of its column
    matrix (bf16_product), stored once with the bias and a ReLU or ReLU6; else the column
    algorithm's GEMMs in bfloat16 (columns.products) with passes for the bias and activation. A
    shallower one runs as in float32 (float32 activations times the weight's values): False,
    and the caller runs it."""
    # (a transposed convolution's product is Wᵀ times the input's own channels, its columns scattered after)
    depth = geom.in_channels // geom.groups * (1 if geom.transposed else math.prod(geom.kernel_size))
    if depth < BF16_MIN_DEPTH:
        return False
    kind = "linear" if activation is None else activation[0]
    if (geom.transposed or geom.groups > 1 or not ctx.be.bf16_panels
            or math.prod(ctx.output.shape[2:]) > BF16_PANELS_MAX_POSITIONS
            or kind not in ("linear", "relu", "bounded_relu")):
        columns.any_forward(geom, weight, ctx, bias, activation)
        return True
    relu, cap = kind != "linear", activation[1] if kind == "bounded_relu" else math.inf
    run = bf16_product(weight, ctx, depth, bias, relu, cap)
    if geom.pointwise:
        _by_samples(geom, ctx, run)
    else:
        columns.forward(geom, weight, ctx, product=run)
    return True
