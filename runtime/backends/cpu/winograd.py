"""The CPU's Winograd convolution F(2x2x2, 3x3x3) and F(2x2, 3x3) for stride-1 kernels of 3
(pyx/winograd.h): the forward, and the input gradient as the same convolution of dy with the
kernel flipped and its in/out channels swapped. The transformed weights are cached per weight
version."""
import numpy as np

from .compiled import _kernels
from .. import columns
from ..columns import as_volume
from .aligned import aligned_copy

# Tiles per block of winograd.h: its transformed input and products, XI · block · (Cp + COp)
# values, stay in cache between the transforms and the GEMMs.
BLOCK_VALUES = 1 << 16
# Every block reads all the transformed weights (XI · Cin · Cout values). Above STREAMED_WEIGHTS
# bytes they come from memory each time rather than from the last-level cache, and blocks of up to
# LARGE_BLOCK_VALUES (fewer per sample) cost less than products that stay in cache: 512 channels
# at 7x7 (16 MiB of weights), batch 1, one thread ran 1.2-1.3x faster; 384 (9 MiB) and 256 gained
# nothing, and the smaller layers lost up to 20% (docs/measurements.md).
STREAMED_WEIGHTS = 12 << 20
LARGE_BLOCK_VALUES = 1 << 20
# G of F(2, 3): the kernel's transform along each axis
_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


def applies(geom):
    """A kernel of 3 along height and width (and depth, or depth 1 without depth padding), stride
    and dilation 1, one group, the same padding on both sides, at most 2 (the input gradient's
    is 2 - padding)."""
    k = geom.kernel_size
    return (not geom.transposed and geom.groups == 1 and max(geom.stride + geom.dilation) == 1 and geom.symmetric
            and k[-2:] == (3, 3) and (geom.nd == 2 or k[0] == 3 or (k[0] == 1 and geom.padding[0] == 0))
            and max(geom.padding) <= 2)


def volumetric(geom):
    """Whether the 3-D transform runs (a kernel of 3 along depth too), its tiles 2x2x2; else the
    2-D one, tiles 2x2 along height and width at every depth."""
    return geom.nd == 3 and geom.kernel_size[0] == 3


def _weights(geom, weight, which):
    """U_ξ = G g Gᵀ along each axis, [XI][Cin][Cout] zero-padded to whole vectors of channels and
    panel-packed per ξ: 'forward', or 'input grad' (flipped taps, in/out channels swapped)."""
    depth3 = volumetric(geom)

    def build(buffer):
        w = buffer.astype(np.float64).reshape((geom.out_channels, geom.in_channels) + geom.kernel_size[-3:])
        if which == "input grad":
            w = w[:, :, ::-1, ::-1, ::-1].transpose(1, 0, 2, 3, 4) if w.ndim == 5 else \
                w[:, :, ::-1, ::-1].transpose(1, 0, 2, 3)
        if w.ndim == 5 and not depth3:
            w = w[:, :, 0]
        u = (np.einsum("ai,bj,ck,oxijk->abcxo", _G, _G, _G, w) if depth3 else
             np.einsum("bj,ck,oxjk->bcxo", _G, _G, w))
        cin, cout = w.shape[1], w.shape[0]
        u = u.reshape(-1, cin, cout)
        lanes = _kernels.winograd_lanes(buffer.dtype == np.float32)
        cp, cop, nr = -(-cin // lanes) * lanes, -(-cout // lanes) * lanes, 2 * lanes  # nr: a panel's columns
        panels = -(-cop // nr)
        padded = np.zeros((u.shape[0], cp, panels * nr))
        padded[:, :cin, :cout] = u
        packed = padded.reshape(u.shape[0], cp, panels, nr).transpose(0, 2, 1, 3)
        return aligned_copy(packed, buffer.dtype).reshape(-1)
    return weight.derived(("winograd", which), build)


def run(geom, weight, ctx, which, src, dst, padding, beta=0.0, bias=None, relu=False, pool=False):
    """dst[n] = (beta·dst[n] +) the Winograd convolution of src[n], split between threads; with
    beta 0, plus bias (None: none) and through a ReLU where relu is set, as the kernel stores;
    with pool, dst is the max pool of that over the tiles (winograd_conv's pool)."""
    packed, depth3 = _weights(geom, weight, which), volumetric(geom)
    c, d, h, w = as_volume(src[0]).shape
    cout = dst.shape[1]
    lanes = _kernels.winograd_lanes(src.dtype == np.float32)
    xi = 64 if depth3 else 16
    # tiles per block: whole row tiles of the panel GEMM, at least one (the outputs then do not
    # depend on the block)
    values = LARGE_BLOCK_VALUES if packed.nbytes > STREAMED_WEIGHTS else BLOCK_VALUES
    rows = _kernels.panel_tile_rows()
    block = max(rows, values // (xi * (-(-c // lanes) + -(-cout // lanes)) * lanes) // rows * rows)
    pd = padding[0] if depth3 else 0
    sizes = _kernels.winograd_workspace(c, cout, d, h, w, pd, padding[1], padding[2], depth3, block,
                                        src.dtype == np.float32)

    def call(x, y, accumulate, threads):
        xcl, v, m = ([ctx.workspace(("winograd " + key, t), (size,)) for t in range(threads)]
                     for key, size in zip(("xcl", "V", "M"), sizes))
        _kernels.winograd_conv(x, packed, y, xcl, v, m, pd, padding[1], padding[2], depth3, block, accumulate,
                               bias, relu, threads, pool)
    columns.over_samples(ctx, src, dst, beta, call, shares_samples=True)


def forward(geom, weight, ctx, bias=None, relu=False, pool=False):
    run(geom, weight, ctx, "forward", ctx.inputs[0], ctx.output, geom.windows[2], 0.0, bias, relu, pool)
