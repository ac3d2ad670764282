"""The CPU backend: numpy arrays, Cython kernels (lamina.backends.cpu._kernels) and GEMM from MKL or OpenBLAS.

Every public method checks shapes, dtypes and contiguity here, at the Python boundary, and says
which kernel and which argument is wrong; the compiled kernels then run without bounds checks and
with the GIL released.
"""
import math

import numpy as np

from .compiled import _kernels as K
from .compiled import _selective
from ..base import ACTIVATIONS, POOL_MODES, Backend, HostStatistics, check_activation, window_parts
from ...precision import ACTIVATION_LEVELS, check_int8_pack, check_precision, quantize_weight, round_to_precision
from ..checks import select_on_host
from ..checks import (check_attention, check_by_column, check_index, check_layer_norm, check_offsets, check_positions,
                      check_selection, gemm_sizes)
from .blas import check_low_precision, default_provider, low_precision_products, mkl, provider
from ...threads import free_threads, get_num_threads
from . import conv_algorithms, fused_recurrence
from .aligned import aligned_empty

_ACT_CODE = {name: i for i, name in enumerate(ACTIVATIONS)}


def check_array(where, name, a, dtype=None, shape=None, ndim=None):
    """Raise a clear error unless a is a C-contiguous numpy array of that dtype and shape."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{where}: {name} must be a numpy array, found {type(a).__name__}")
    if dtype is not None and a.dtype != dtype:
        raise TypeError(f"{where}: {name} must be {np.dtype(dtype)}, found {a.dtype}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{where}: {name} must be C-contiguous, found a strided view "
                         f"(shape {a.shape}, strides {a.strides}); pass np.ascontiguousarray(...)")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{where}: {name} must have {ndim} dimensions, found shape {a.shape}")
    if shape is not None and tuple(a.shape) != tuple(shape):
        raise ValueError(f"{where}: {name} must have shape {tuple(shape)}, found {a.shape}")
    return a


def check_matrix(where, name, a, dtype=None):
    """A 2-D numpy array whose rows are contiguous (the rows themselves may be strided: a block
    of columns of a larger matrix is fine for BLAS)."""
    if not isinstance(a, np.ndarray):
        raise TypeError(f"{where}: {name} must be a numpy array, found {type(a).__name__}")
    if dtype is not None and a.dtype != dtype:
        raise TypeError(f"{where}: {name} must be {np.dtype(dtype)}, found {a.dtype}")
    if a.ndim != 2:
        raise ValueError(f"{where}: {name} must have 2 dimensions, found shape {a.shape}")
    if a.dtype not in (np.float32, np.float64):
        raise TypeError(f"{where}: {name} must be float32 or float64, found {a.dtype}")
    if (a.shape[1] > 1 and a.strides[1] != a.itemsize) or (a.shape[0] > 1 and a.strides[0] < a.shape[1] * a.itemsize):
        raise ValueError(f"{where}: {name} must have contiguous rows, found strides {a.strides} for shape "
                         f"{a.shape}; pass np.ascontiguousarray(...)")
    return a


def _float(where, name, a, **kw):
    check_array(where, name, a, **kw)
    if a.dtype not in (np.float32, np.float64):
        raise TypeError(f"{where}: {name} must be float32 or float64, found {a.dtype}")
    return a


def _same(where, ref_name, ref, **others):
    """Every array in others has ref's dtype and shape."""
    for name, a in others.items():
        check_array(where, name, a, dtype=ref.dtype, shape=ref.shape)


def _flat(a):
    return a.reshape(-1)


def _rows(a):
    """View an array with a leading batch axis as 2-D [rows, features]."""
    return a.reshape(a.shape[0], -1) if a.ndim != 2 else a


def _row_strided(a):
    """Whether a compiled kernel with a row stride reads matrix a as it lies: its values along a
    row adjacent and its rows following each other without overlap (a block of columns of a
    larger matrix, or the matrix)."""
    adjacent = a.shape[1] <= 1 or a.strides[1] == a.itemsize
    return adjacent and (a.shape[0] <= 1 or a.strides[0] >= a.shape[1] * a.itemsize)


def _last_axis(a):
    """View an array as 2-D rows along its last axis (softmax normalises each such row)."""
    return a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a


class PackedMatrix:
    """alpha * op(B) packed for products with up to max_rows rows on the left: MKL's packed format
    (`handle`) where MKL is the GEMM provider, else lamina's column panels (`panels`, panels.h);
    for bfloat16 products MKL's bfloat16 format ('mkl-bfloat16', whichever the provider), for int8
    products MKL's s8 format ('mkl-int8') or lamina's int8 panels ('int8-panels', in `panels`; int8_panels.h),
    each with its output channels' scales (times alpha) and the sums of their integers. `provider`
    names the format; only a backend of that provider computes with it. Where float32 products
    serve bfloat16 or int8 (CPUBackend.low_precision), the pack
    is a float32 one of the weight's values in that precision and `operands` names it: each
    product reduces its left operand the same way first, and a product of more rows than a pack
    serves well multiplies the reduced values themselves."""

    def __init__(self, provider, k, n, dtype, max_rows, handle=None, panels=None, scales=None, sums=None):
        self.provider, self.k, self.n, self.dtype, self.max_rows = provider, k, n, dtype, max_rows
        self.handle, self.panels, self.scales, self.sums = handle, panels, scales, sums
        # (reduced operands: the precision, and op(values)·alpha, the weight's reduced values
        # as given, for products of more rows than a pack serves faster than the plain GEMM)
        self.operands = self.values = self.trans = self.alpha = None


# An OpenBLAS GEMM of fewer multiply-adds runs on one thread (split, it would pay more in starting
# the team than it saves: on 2 threads the split by the team gained 1.2-1.7x from 4 M
# multiply-adds while its workers watched, and broke even there after they slept,
# docs/measurements.md)
GEMM_SPLIT_MIN = 1 << 22
# A panel-packed product of fewer multiply-adds runs on one thread (waking another costs more
# than it saves); a larger one is split by runs of panels (each thread reads only its part of a
# pack that outgrows a core's L2), or by blocks of rows when each thread gets at least
# PANEL_ROW_SPLIT rows (then each reads the whole pack once for many rows).
PANEL_SPLIT_MIN = 1 << 21
PANEL_ROW_SPLIT = 256
# At inference a Linear's product runs from its weight's panels, faster than OpenBLAS on the
# weight (which packs it again at every call) up to a few hundred rows; with more, OpenBLAS's own
# blocking wins.
PACK_MAX_ROWS = 512
# MKL's packed product of a fixed weight beats its plain one on small batches (the plain one packs
# the weight again at every call): 1.1-2.4x for 1 to 128 rows of a 384 x 1536 or 1536 x 384 weight,
# from one pack made for 128 rows. MKL blocks a pack for its row count, and one made for 512 rows
# runs 0.4-0.6x on fewer, so a pack serves up to the rows it was made for and larger products
# use the plain one (1.0-1.1x from a pack there).
MKL_PACK_ROWS = 128
# int32 sums of an int8 product per block of rows (16 MiB): the scratch of a large batch stays
# bounded; smaller blocks made MKL's product slower than the cache they save
INT8_BLOCK = 1 << 22
# lamina's int8 product of fewer multiply-adds runs on one thread (it runs 2.3-3.6x the float32
# panels' speed, so twice PANEL_SPLIT_MIN)
INT8_SPLIT_MIN = 1 << 22
# lamina's bfloat16 product of fewer multiply-adds runs on one thread (it runs about 1.7x the
# float32 panels' speed)
BF16_SPLIT_MIN = 1 << 22
# The bfloat16 panels of an op(b) of fewer values are packed on one thread (a member's start costs
# about as much as packing 16 K values)
BF16_PACK_SPLIT_MIN = 1 << 16
PACK_MAX_DEPTH = 8192


def _pack_threads(k, n):
    """Threads that pack the bfloat16 panels of a k x n op(b)."""
    return free_threads() if k * n >= BF16_PACK_SPLIT_MIN else 1


class CPUBackend(HostStatistics, Backend):
    name = "cpu"
    host_arrays = True

    def __init__(self, blas=None, low_precision=None):
        """blas: the float32 GEMM's provider ('mkl', 'openblas'; blas.default_provider);
        low_precision: what multiplies bfloat16 and int8 ('mkl': MKL's low-precision GEMMs,
        whichever provider does float32; 'lamina': lamina's int8 panels, and the float32
        provider's products of bfloat16 operands; 'float32': that provider's products of the
        reduced operands for both; blas.low_precision_products)."""
        self.blas_name = blas or default_provider()
        self.blas = provider(self.blas_name)
        self._gemm_functions = self.blas.gemm_functions() if self.blas_name == "openblas" else None
        self.low_precision = (check_low_precision(low_precision, "CPUBackend(low_precision=...)") if low_precision
                              else low_precision_products())
        self._mkl = mkl() if self.low_precision == "mkl" else None

    def __repr__(self):
        return f"CPUBackend(blas={self.blas_name!r}, low_precision={self.low_precision!r})"

    # -- arrays
    def empty(self, shape, dtype):
        return aligned_empty(shape, dtype)

    def fill(self, a, value):
        a.fill(value)

    def from_host(self, array):
        return np.ascontiguousarray(array)

    def to_host(self, a):
        return a

    def copy(self, src, dst):
        check_array("copy", "dst", dst, dtype=src.dtype, shape=src.shape)
        np.copyto(dst, src)

    # -- products
    def gemm(self, a, b, c, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        self._gemm(a, b, c, trans_a, trans_b, alpha, beta, None)

    def gemm_in(self, precision, a, b, c, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        """bfloat16 through MKL's bfloat16 GEMM on the operands' bfloat16 bits (low_precision
        'mkl'), or lamina's bfloat16 panels of op(b) made for this product (bf16_panels); else the
        rounded operands' float32 product."""
        if precision == "bfloat16" and self.bf16_panels and a.dtype == np.float32:
            return self._bf16_gemm(a, b, c, trans_a, trans_b, alpha, beta)
        if precision != "bfloat16" or self.low_precision != "mkl":
            return super().gemm_in(precision, a, b, c, trans_a, trans_b, alpha, beta)
        check_matrix("gemm_in", "a", a, dtype=np.float32)
        check_matrix("gemm_in", "b", b, dtype=np.float32)
        check_matrix("gemm_in", "c", c, dtype=np.float32)
        _, _, k = gemm_sizes("gemm_in", a, b, c, trans_a, trans_b)
        if k == 0:  # (an empty product: beta c)
            return super().gemm_in("float32", a, b, c, trans_a, trans_b, alpha, beta)
        bits = []
        for name, x in (("a", a), ("b", b)):
            out = self.scratch(f"gemm_in bfloat16 {name}", x.shape, np.uint16)
            K.to_bfloat16(_flat(np.ascontiguousarray(x)), _flat(out))
            bits.append(out)
        if free_threads() > 1:
            K.team_rest()
        self._mkl.gemm_bf16(bits[0], bits[1], c, trans_a, trans_b, alpha, beta)

    def _bf16_gemm(self, a, b, c, trans_a, trans_b, alpha, beta):
        """c = alpha op(a) op(b) + beta c in bfloat16 on lamina's panels of op(b), made for this
        product on the team; op(a)'s rows are rounded where they lie (a's columns where op(a) is
        its transpose: no transposed copy of either operand)."""
        check_matrix("gemm_in", "a", a, dtype=np.float32)
        check_matrix("gemm_in", "b", b, dtype=np.float32)
        check_matrix("gemm_in", "c", c, dtype=np.float32)
        m, n, k = gemm_sizes("gemm_in", a, b, c, trans_a, trans_b)
        if k == 0 or m == 0 or n == 0:  # (an empty product: beta c)
            return super().gemm_in("float32", a, b, c, trans_a, trans_b, alpha, beta)
        panels = self.scratch("gemm_in bfloat16 panels", (K.bf16_pack_size(k, n),), np.uint16)
        K.bf16_pack(np.ascontiguousarray(b), trans_b, panels, threads=_pack_threads(k, n))
        self._bf16_on_panels(a, panels, alpha, c, beta, None, trans_a)

    def _bf16_on_panels(self, a, panels, alpha, c, beta, bias, trans_a=False, threads=None, **store):
        """c = alpha op(a)·P + (bias, or beta c) for P's bfloat16 panels (K.bf16_pack), op(a)'s
        rows rounded in scratch, on a compiled team of the free threads (at most `threads`) for
        a large product; `store`: K.bf16_product's trans_c, act and cap. a is read and c written
        where they lie when their rows are each contiguous (blocks of columns of larger
        matrices), else by way of contiguous copies."""
        (m, k), n = a.shape[::-1] if trans_a else a.shape, c.shape[0 if store.get("trans_c") else 1]
        a = a if _row_strided(a) else np.ascontiguousarray(a)
        out = c if _row_strided(c) else self.scratch("bfloat16 c", c.shape, np.float32)
        if out is not c and bias is None and beta != 0:
            np.copyto(out, c)
        u = self.scratch("bfloat16 rows", (m, K.bf16_row_values(k)), np.uint16)
        team = min(free_threads(), threads or free_threads()) if m * n * k >= BF16_SPLIT_MIN else 1
        K.bf16_product(a, panels, alpha, out, beta, bias, u, threads=team, by_rows=m >= PANEL_ROW_SPLIT * team,
                       trans_a=trans_a, **store)
        if out is not c:
            np.copyto(c, out)

    def bf16_positions(self, x, packed, y, bias=None, act=0, cap=0.0, threads=None):
        """y = act(W x + bias[:, None]) in bfloat16 for a convolution's weight W [out, depth]
        packed as a Linear's (pack(W, trans=True, precision='bfloat16') on lamina's panels), x
        [depth, positions] and y [out, positions] (blocks of columns of larger matrices allowed):
        x's columns rounded to bfloat16 where they lie and each tile of positions x channels
        stored transposed, with its bias and act (0 none, 1 ReLU, 2 ReLU capped at cap); on up to
        `threads` of the free threads. Only where bf16_panels."""
        if packed.provider != "bf16-panels":
            raise ValueError(f"bf16_positions: the weight must be packed on lamina's bfloat16 panels, found "
                             f"{packed.provider!r}")
        check_matrix("bf16_positions", "x", x, dtype=np.float32)
        check_matrix("bf16_positions", "y", y, dtype=np.float32)
        if x.shape[0] != packed.k or y.shape != (packed.n, x.shape[1]):
            raise ValueError(f"bf16_positions: a weight of {packed.n} x {packed.k} takes x ({packed.k}, positions) "
                             f"and y ({packed.n}, positions), found x {x.shape} and y {y.shape}")
        if x.shape[1] == 0:
            return
        self._bf16_on_panels(x, packed.panels, packed.alpha, y, 0.0, bias, trans_a=True, threads=threads,
                             trans_c=True, act=act, cap=cap)

    def gemm_bias(self, a, b, c, bias, trans_a=False, trans_b=False):
        """Each block of c takes its bias rows just before its product adds to them (beta 1), not
        in a pass over all of c afterwards, which reads and writes c once more from memory."""
        self._gemm(a, b, c, trans_a, trans_b, 1.0, 0.0, bias)

    def _gemm(self, a, b, c, trans_a, trans_b, alpha, beta, bias):
        check_matrix("gemm", "a", a)
        check_matrix("gemm", "b", b, dtype=a.dtype)
        check_matrix("gemm", "c", c, dtype=a.dtype)
        m, n, k = gemm_sizes("gemm", a, b, c, trans_a, trans_b)

        if bias is not None:
            check_array("gemm_bias", "bias", bias, dtype=c.dtype, shape=(n,))

        def block(a, b, c, bias):
            """c = alpha op(a) op(b) + (bias rows, or beta c)."""
            if bias is not None:
                np.copyto(c, bias)  # (the product adds to it)
            if k:
                self.blas.gemm(a, b, c, trans_a, trans_b, alpha, 1.0 if bias is not None else beta)
            elif bias is None and beta == 0:  # the product is empty
                c.fill(0)
            elif bias is None:
                np.multiply(c, beta, out=c)
        # OpenBLAS runs on one thread (lamina.threads says why): a large product is split into
        # blocks of c's longer side, one per free thread, each block reading the whole of the other
        # operand, the blocks' calls made by lamina's compiled team (MKL threads through libgomp
        # itself)
        big = self.blas_name == "openblas" and k and m * n * k >= GEMM_SPLIT_MIN
        threads = free_threads() if big else 1
        if threads == 1:
            self._mkl_threads_start()
            block(a, b, c, bias)
            return
        K.gemm_team(self._gemm_functions[a.dtype != np.float32], a, b, c, trans_a, trans_b, alpha, beta, bias,
                    threads, m > n)

    def _mkl_threads_start(self):
        """Before a product MKL threads itself: the compiled team's workers (team.h) sleep at once
        instead of watching for work on the CPUs MKL's threads are about to use."""
        if self.blas_name == "mkl" and free_threads() > 1:
            K.team_rest()

    def pack(self, b, trans=False, alpha=1.0, max_rows=1, precision="float32"):
        _float("pack", "b", b, ndim=2)
        k, n = (b.shape[1], b.shape[0]) if trans else b.shape
        if k == 0 or n == 0:
            raise ValueError(f"pack: b must not be empty, found shape {b.shape}")
        check_precision(precision, "pack")
        check_int8_pack(precision, b, trans)
        if precision == "int8" and self.low_precision == "lamina":
            return self._int8_pack(b, alpha, max_rows)
        if precision == "bfloat16" and b.dtype == np.float32 and self.bf16_panels:
            return self._bf16_pack(b, trans, alpha, max_rows)
        if precision != "float32" and self.low_precision != "mkl":
            return self.pack_reduced(b, trans, alpha, max_rows, precision)
        if precision == "bfloat16":
            bits = np.empty(b.shape, np.uint16)
            K.to_bfloat16(_flat(b), _flat(bits))
            return PackedMatrix("mkl-bfloat16", k, n, b.dtype, max(max_rows, 1),
                                handle=self._mkl.pack_b_bf16(bits, trans, alpha, max_rows))
        if precision == "int8":
            q, scales = quantize_weight(b)
            return PackedMatrix("mkl-int8", k, n, b.dtype, max(max_rows, 1), handle=self._mkl.pack_b_s8(q, max_rows),
                                scales=(scales * np.float32(alpha)).astype(np.float32),
                                sums=q.sum(axis=1, dtype=np.int32))
        return self._float_pack(b, trans, alpha, max_rows)

    def _int8_pack(self, b, alpha, max_rows):
        """lamina's int8 panels of b [n, k] quantized per output channel (its rows)."""
        q, scales = quantize_weight(b)
        n, k = q.shape
        if k > K.INT8_MAX_DEPTH:
            raise ValueError(f"pack: int8 products sum exactly in int32 to a depth of {K.INT8_MAX_DEPTH}, found a "
                             f"weight of depth {k}")
        panels = aligned_empty((K.int8_pack_size(k, n),), np.int8)
        K.int8_pack(q, panels)
        return PackedMatrix("int8-panels", k, n, b.dtype, max(max_rows, 1), panels=panels,
                            scales=(scales * np.float32(alpha)).astype(np.float32), sums=q.sum(axis=1, dtype=np.int32))

    def pack_reduced(self, b, trans=False, alpha=1.0, max_rows=1, precision="bfloat16"):
        """A float32 pack of b's values in `precision` (rounded to bfloat16, or int8's per channel),
        for float32 products of the reduced operands (`operands` names the precision); pack's
        form where no product of that precision serves, and the backward's of the fused recurrence."""
        _float("pack_reduced", "b", b, ndim=2)
        check_precision(precision, "pack_reduced")
        values = round_to_precision(b, precision)
        packed = self._float_pack(values, trans, alpha, max_rows)
        packed.operands, packed.values, packed.trans, packed.alpha = precision, values, trans, alpha
        return packed

    @property
    def bf16_panels(self):
        """Whether bfloat16 products run lamina's bfloat16 panels (bf16_panels.h: low_precision
        'lamina' on a CPU with AVX512-BF16, in the AVX-512 build)."""
        return self.low_precision == "lamina" and K.bf16_kernel_runs()

    def _bf16_pack(self, b, trans, alpha, max_rows):
        """lamina's bfloat16 panels of op(b), its values rounded to bfloat16."""
        k, n = (b.shape[1], b.shape[0]) if trans else b.shape
        panels = aligned_empty((K.bf16_pack_size(k, n),), np.uint16)
        K.bf16_pack(np.ascontiguousarray(b), trans, panels, threads=_pack_threads(k, n))
        packed = PackedMatrix("bf16-panels", k, n, b.dtype, max(max_rows, 1), panels=panels)
        packed.alpha = alpha
        return packed

    def _float_pack(self, b, trans, alpha, max_rows):
        if self.blas_name == "mkl":
            k, n = (b.shape[1], b.shape[0]) if trans else b.shape
            return PackedMatrix("mkl", k, n, b.dtype, max(max_rows, 1), handle=self.blas.pack_b(b, trans, alpha, max_rows))
        return self.pack_panels(b, trans, alpha, max_rows)

    def pack_panels(self, b, trans=False, alpha=1.0, max_rows=1, precision="float32"):
        """lamina's panels of alpha·op(b) whatever the BLAS (pack's 'panels' provider), for kernels
        that read the panels themselves (the pointwise convolution by positions)."""
        _float("pack_panels", "b", b, ndim=2)
        if precision != "float32":
            raise ValueError(f"pack_panels: panels hold float values, found precision {precision!r}")
        k, n = (b.shape[1], b.shape[0]) if trans else b.shape
        panels = aligned_empty(K.panel_size(b, trans), b.dtype)
        K.panel_pack(b, trans, alpha, panels)
        return PackedMatrix("panels", k, n, b.dtype, max(max_rows, 1), panels=panels)

    def packs_fixed_weights(self, m, k, n):
        """Lamina's panels (every provider but MKL) for up to PACK_MAX_ROWS rows and a depth of up
        to PACK_MAX_DEPTH; MKL's pack, made for MKL_PACK_ROWS rows, for up to that many."""
        if self.blas_name == "mkl":
            return MKL_PACK_ROWS if m <= MKL_PACK_ROWS else 0
        return m if m <= PACK_MAX_ROWS and k <= PACK_MAX_DEPTH else 0

    def packed_gemm(self, a, packed, c, beta=0.0):
        self._packed_product(a, packed, c, beta, None)

    def packed_gemm_bias(self, a, packed, c, bias):
        self._packed_product(a, packed, c, 0.0, bias)

    def _packed_product(self, a, packed, c, beta, bias):
        expected = {"float32": "mkl" if self.blas_name == "mkl" else "panels",
                    "bfloat16": ("mkl-bfloat16" if self.low_precision == "mkl" else
                                 "bf16-panels" if self.bf16_panels else None),
                    "int8": {"mkl": "mkl-int8", "lamina": "int8-panels"}.get(self.low_precision)}
        if not isinstance(packed, PackedMatrix) or packed.provider not in expected.values():
            raise ValueError(f"packed_gemm: {self} computes with {expected['float32']!r} packs, found "
                             f"{getattr(packed, 'provider', type(packed).__name__)!r} (pack with this backend; "
                             f"its bfloat16 and int8 packs: {expected['bfloat16'] or expected['float32']!r} and "
                             f"{expected['int8'] or expected['float32']!r})")
        check_array("packed_gemm", "a", a, dtype=packed.dtype, ndim=2)
        check_array("packed_gemm", "c", c, dtype=packed.dtype, shape=(a.shape[0], packed.n))
        if bias is not None:
            check_array("packed_gemm_bias", "bias", bias, dtype=packed.dtype, shape=(packed.n,))
        if a.shape[1] != packed.k:
            raise ValueError(f"packed_gemm: a must have {packed.k} columns (the packed matrix is "
                             f"{packed.k}x{packed.n}), found {a.shape[1]}")
        if a.shape[0] > packed.max_rows:
            raise ValueError(f"packed_gemm: a has {a.shape[0]} rows, the pack was made for at most "
                             f"{packed.max_rows}")
        m, n = c.shape
        if packed.provider == "mkl-int8":
            return self._int8_packed_product(a, packed, c, beta, bias)
        if packed.provider == "int8-panels":
            return self._int8_panel_product(a, packed, c, beta, bias)
        if packed.provider == "bf16-panels":  # (lamina's bfloat16 product: bf16_panels.h)
            return self._bf16_on_panels(a, packed.panels, packed.alpha, c, beta, bias)
        if packed.operands is not None:
            a = self.reduced_operand(a, packed.operands)
            if not self.packs_fixed_weights(m, packed.k, n):  # (the pack serves fewer rows faster)
                return self._gemm(a, packed.values, c, False, packed.trans, packed.alpha, beta, bias)
        if packed.provider == "mkl-bfloat16":
            bits = self.scratch("packed_gemm bfloat16", a.shape, np.uint16)
            K.to_bfloat16(_flat(a), _flat(bits))
            if bias is not None:
                np.copyto(c, bias)  # (the product adds to it)
            if free_threads() > 1:
                K.team_rest()
            self._mkl.packed_gemm_bf16(bits, packed.handle, c, beta if bias is None else 1.0)
            return
        if packed.handle is not None:
            if bias is not None:
                np.copyto(c, bias)  # (the product adds to it)
            self._mkl_threads_start()
            self.blas.packed_gemm(a, packed.handle, c, beta if bias is None else 1.0)
            return
        # lamina's panels, shared by a compiled team of the free threads; each member sets its part
        # of c to the bias just before its product adds to it
        threads = free_threads() if m * n * packed.k >= PANEL_SPLIT_MIN else 1
        K.panel_gemm(a, packed.panels, n, c, beta, threads=threads, by_rows=m >= PANEL_ROW_SPLIT * threads,
                     bias=bias)

    def _int8_packed_product(self, a, packed, c, beta, bias):
        """a's rows quantized to u8 with their scales and zero points, MKL's u8 x s8 product in
        int32, and the scaling back to float32 (with the bias, or beta c); by blocks of rows of
        at most INT8_BLOCK int32 sums."""
        m, n = c.shape
        block = max(1, INT8_BLOCK // n)
        u = self.scratch("int8 rows", (min(m, block), a.shape[1]), np.uint8)
        row_scales = self.scratch("int8 row scales", (min(m, block),), np.float32)
        zeros = self.scratch("int8 zero points", (min(m, block),), np.int32)
        sums = self.scratch("int8 sums", (min(m, block), n), np.int32)
        levels = self.int8_activation_levels
        for r0 in range(0, m, block):
            rows = slice(r0, min(m, r0 + block))
            b = rows.stop - r0
            K.quantize_rows_u8(a[rows], u[:b], row_scales[:b], zeros[:b], levels)
            if free_threads() > 1:
                K.team_rest()
            self._mkl.packed_gemm_u8s8(u[:b], packed.handle, sums[:b])
            K.dequantize_rows(sums[:b], row_scales[:b], zeros[:b], packed.scales, packed.sums, c[rows], bias, beta)

    def _int8_panel_product(self, a, packed, c, beta, bias):
        """lamina's int8 product (int8_panels.h): a's rows quantized to u8 and multiplied by the
        panels on a compiled team, the int32 sums scaled back to float32 as each tile is stored."""
        m, n = c.shape
        u = self.scratch("int8 rows", (m, K.int8_row_bytes(packed.k)), np.uint8)
        row_scales = self.scratch("int8 row scales", (m,), np.float32)
        zeros = self.scratch("int8 zero points", (m,), np.int32)
        threads = free_threads() if m * n * packed.k >= INT8_SPLIT_MIN else 1
        K.int8_product(a, packed.panels, packed.scales, packed.sums, c, beta, bias, u, row_scales, zeros,
                       threads=threads, by_rows=m >= PANEL_ROW_SPLIT * threads)

    def reduced_operand(self, a, precision):
        """a (C-contiguous float32 rows) as a float32 product computing a `precision` one
        multiplies it: rounded to bfloat16, or each row snapped to its u8 grid; in scratch."""
        reduced = self.scratch("reduced operand", a.shape, np.float32)
        if precision == "bfloat16":
            K.round_bfloat16(_flat(a), _flat(reduced))
        else:
            K.snap_rows(a, reduced, ACTIVATION_LEVELS)
        return reduced

    @property
    def int8_activation_levels(self):
        """Steps of an activation row in int8 products: 255 where MKL's u8 x s8 product sums
        exactly (an int8 dot product: VNNI, AMX), else 127, which keeps its int16 pair sums from
        saturating (probed once); in lamina's int8 panels 127 (the same reason); in float32
        products, 255."""
        levels = self.__dict__.get("_int8_levels")
        if levels is None and self.low_precision == "lamina":
            levels = self.__dict__["_int8_levels"] = K.INT8_LEVELS
        if levels is None:
            exact = self.low_precision == "float32" or self._mkl.u8s8_sums_exact()
            levels = self.__dict__["_int8_levels"] = ACTIVATION_LEVELS if exact else 127
        return levels

    # -- bias, element-wise, rows
    def add_bias(self, y, b):
        y2 = _rows(_float("add_bias", "y", y))
        check_array("add_bias", "b", b, dtype=y.dtype, shape=(y2.shape[1],))
        K.add_bias(y2, b)

    def bias_grad(self, dy, db, beta=0.0):
        dy2 = _rows(_float("bias_grad", "dy", dy))
        check_array("bias_grad", "db", db, dtype=dy.dtype, shape=(dy2.shape[1],))
        K.bias_grad(dy2, db, beta)

    def activation(self, kind, x, y, slope=0.01):
        check_activation(kind, "activation")
        _float("activation", "x", x)
        _same("activation", "x", x, y=y)
        if kind in ("softmax", "log_softmax"):
            K.softmax_forward(_last_axis(x), _last_axis(y), kind == "log_softmax")
        else:
            K.activation_forward(_ACT_CODE[kind], _flat(x), _flat(y), slope)

    def activation_backward(self, kind, y, dy, dx, beta=0.0, slope=0.01):
        check_activation(kind, "activation_backward")
        _float("activation_backward", "y", y)
        _same("activation_backward", "y", y, dy=dy, dx=dx)
        if kind in ("softmax", "log_softmax"):
            K.softmax_backward(_last_axis(y), _last_axis(dy), _last_axis(dx), beta, kind == "log_softmax")
        else:
            K.activation_backward(_ACT_CODE[kind], _flat(y), _flat(dy), _flat(dx), beta, slope)

    def axpby(self, alpha, x, beta, y):
        _float("axpby", "x", x)
        _same("axpby", "x", x, y=y)
        K.axpby(alpha, _flat(x), beta, _flat(y))

    def multiply(self, a, b, out, beta=0.0):
        _float("multiply", "a", a)
        _same("multiply", "a", a, b=b, out=out)
        K.multiply(_flat(a), _flat(b), _flat(out), beta)

    def select(self, cond, a, b, out):
        select_on_host(cond, a, b, out)

    def round_to_bfloat16(self, x, y):
        check_array("round_to_bfloat16", "x", x, dtype=np.float32)
        _same("round_to_bfloat16", "x", x, y=y)
        K.round_bfloat16(_flat(x), _flat(y))

    def quantize_rows(self, x, q, scales, levels, symmetric=False):
        check_array("quantize_rows", "x", x, dtype=np.float32, ndim=2)
        check_array("quantize_rows", "q", q, dtype=np.float32, shape=x.shape)
        check_array("quantize_rows", "scales", scales, dtype=np.float32, shape=(x.shape[0],))
        if not 1 <= levels <= 1 << 16:
            raise ValueError(f"quantize_rows: levels must be in [1, 65536], found {levels}")
        K.quantize_rows(_rows(x), _rows(q), scales, levels, symmetric)

    def sum_squares(self, x, rows=None):
        _float("sum_squares", "x", x)
        if rows is None:
            return float(K.sum_squares(_flat(x)))
        check_array("sum_squares", "rows", rows, dtype=np.int32, ndim=1)
        check_index("sum_squares", "rows", rows, x.shape[0])
        return float(K.sum_squares_rows(_rows(x), rows))

    def gather_rows(self, src, index, dst, col=0):
        src2 = _rows(_float("gather_rows", "src", src))
        check_array("gather_rows", "index", index, dtype=np.int32, ndim=1)
        dst2 = _rows(check_array("gather_rows", "dst", dst, dtype=src.dtype))
        if dst.shape[0] != len(index) or not 0 <= col <= src2.shape[1] - dst2.shape[1]:
            raise ValueError(f"gather_rows: dst {dst.shape} must have one row per index ({len(index)}) "
                             f"and fit into src {src.shape} at column {col}")
        check_index("gather_rows", "index", index, src.shape[0])
        K.gather_rows(src2, index, dst2, col)

    def scatter_rows(self, src, index, dst, beta=0.0, col=0):
        src2 = _rows(_float("scatter_rows", "src", src))
        check_array("scatter_rows", "index", index, dtype=np.int32, shape=(src.shape[0],))
        dst2 = _rows(check_array("scatter_rows", "dst", dst, dtype=src.dtype))
        if not 0 <= col <= dst2.shape[1] - src2.shape[1]:
            raise ValueError(f"scatter_rows: src {src.shape} does not fit into dst {dst.shape} at column {col}")
        check_index("scatter_rows", "index", index, dst.shape[0])
        K.scatter_rows(src2, index, dst2, col, beta)

    def scatter_add_rows(self, src, ids, dst):
        src2 = _rows(_float("scatter_add_rows", "src", src))
        check_array("scatter_add_rows", "ids", ids, dtype=np.int32, shape=(src.shape[0],))
        dst2 = _rows(check_array("scatter_add_rows", "dst", dst, dtype=src.dtype))
        if dst2.shape[1] != src2.shape[1]:
            raise ValueError(f"scatter_add_rows: dst rows of {dst2.shape[1]} values must match src's {src2.shape[1]}")
        check_index("scatter_add_rows", "ids", ids, dst.shape[0])
        K.scatter_add_rows(src2, ids, dst2)

    def fill_rows(self, dst, rows, value):
        dst2 = _rows(_float("fill_rows", "dst", dst))
        check_array("fill_rows", "rows", rows, dtype=np.int32, ndim=1)
        check_index("fill_rows", "rows", rows, dst.shape[0])
        K.fill_rows(dst2, rows, value)

    @staticmethod
    def _row_update(where, rows, p, **state):
        """Check a row update's arrays; returns them as 2-D [rows, values] views (a 1-D
        parameter such as a bias has one value per row)."""
        _float(where, "p", p)
        _same(where, "p", p, **state)
        check_array(where, "rows", rows, dtype=np.int32, ndim=1)
        check_index(where, "rows", rows, p.shape[0])
        return [_rows(a) for a in (p, *state.values())]

    def sgd_update_rows(self, p, g, v, rows, lr, momentum=0.0, dampening=0.0, nesterov=False):
        state = dict(g=g, v=v) if momentum else dict(g=g)
        p2, g2, *v2 = self._row_update("sgd_update_rows", rows, p, **state)
        K.sgd_update_rows(p2, g2, v2[0] if momentum else p2, rows, lr, momentum, dampening, nesterov)

    def adam_update_rows(self, p, g, m, v, rows, lr, beta1, beta2, eps, step):
        if step < 1:
            raise ValueError(f"adam_update_rows: step counts from 1, found {step}")
        K.adam_update_rows(*self._row_update("adam_update_rows", rows, p, g=g, m=m, v=v), rows, lr,
                           beta1, beta2, eps, step)

    def adagrad_update_rows(self, p, g, s, rows, lr, eps):
        K.adagrad_update_rows(*self._row_update("adagrad_update_rows", rows, p, g=g, s=s), rows, lr, eps)

    # -- sequences
    def sequence_pool(self, mode, x, starts, out, argmax):
        x2 = _rows(_float("sequence_pool", "x", x))
        check_array("sequence_pool", "starts", starts, dtype=np.int32, shape=(out.shape[0] + 1,))
        out2 = _rows(check_array("sequence_pool", "out", out, dtype=x.dtype))
        check_array("sequence_pool", "argmax", argmax, dtype=np.int32, shape=out2.shape)
        check_offsets("sequence_pool", "starts", starts, x2.shape[0])
        K.sequence_pool(POOL_MODES.index(mode), x2, starts, out2, argmax)

    def sequence_pool_backward(self, mode, dy, starts, argmax, dx, beta=0.0):
        dy2 = _rows(_float("sequence_pool_backward", "dy", dy))
        check_array("sequence_pool_backward", "starts", starts, dtype=np.int32, shape=(dy.shape[0] + 1,))
        check_array("sequence_pool_backward", "argmax", argmax, dtype=np.int32, shape=dy2.shape)
        dx2 = _rows(check_array("sequence_pool_backward", "dx", dx, dtype=dy.dtype))
        check_offsets("sequence_pool_backward", "starts", starts, dx2.shape[0])
        if mode == "max":
            check_index("sequence_pool_backward", "argmax", argmax, dx2.shape[0])
        K.sequence_pool_backward(POOL_MODES.index(mode), dy2, starts, argmax, dx2, beta)

    def sequence_softmax(self, x, starts, y):
        _float("sequence_softmax", "x", x)
        _same("sequence_softmax", "x", x, y=y)
        check_array("sequence_softmax", "starts", starts, dtype=np.int32, ndim=1)
        check_offsets("sequence_softmax", "starts", starts, x.size)
        K.sequence_softmax(_flat(x), starts, _flat(y))

    def sequence_softmax_backward(self, y, dy, starts, dx, beta=0.0):
        _float("sequence_softmax_backward", "y", y)
        _same("sequence_softmax_backward", "y", y, dy=dy, dx=dx)
        check_array("sequence_softmax_backward", "starts", starts, dtype=np.int32, ndim=1)
        check_offsets("sequence_softmax_backward", "starts", starts, y.size)
        K.sequence_softmax_backward(_flat(y), _flat(dy), starts, _flat(dx), beta)

    # -- attention and layer normalization
    def attention(self, qkv, starts, heads, scale, causal, out, lse):
        self._attention_arrays("attention", qkv, starts, heads, out, lse)
        K.attention(qkv, starts, heads, scale, causal, out, lse, self._attention_scratch(out, starts, heads, False))

    def attention_backward(self, qkv, out, lse, dout, starts, heads, scale, causal, dqkv):
        self._attention_arrays("attention_backward", qkv, starts, heads, out, lse, dout=dout, dqkv=dqkv)
        K.attention_backward(qkv, out, lse, dout, starts, heads, scale, causal, dqkv,
                             self._attention_scratch(out, starts, heads, True))

    @staticmethod
    def _attention_arrays(where, qkv, starts, heads, out, lse, **others):
        _float(where, "out", out, ndim=2)
        for name, a in dict(qkv=qkv, lse=lse, **others).items():
            check_array(where, name, a, dtype=out.dtype)
        check_array(where, "starts", starts, dtype=np.int32, ndim=1)
        check_attention(where, qkv, starts, heads, out, lse, **others)

    def _attention_scratch(self, out, starts, heads, backward):
        """Each thread's scratch: the transposed keys (and values, backward) of its sequence."""
        longest = int(np.diff(starts).max()) if len(starts) > 1 else 0
        size = K.attention_scratch_size(longest, out.shape[1] // heads, backward)
        return self.scratch("attention", (get_num_threads(), max(1, size)), out.dtype)

    def layer_norm(self, x, gamma, beta, eps, y, mean, rstd, center=True):
        self._norm_arrays("layer_norm", x, mean, rstd, {"gamma": gamma, "beta": beta}, {"y": y})
        K.layer_norm(x, self._present(gamma, x), self._present(beta, x), eps, center, y, mean, rstd)

    def layer_norm_backward(self, x, dy, mean, rstd, gamma, dx=None, dx_beta=0.0, dgamma=None, dgamma_beta=0.0,
                            dbeta=None, dbeta_beta=0.0, center=True):
        self._norm_arrays("layer_norm_backward", x, mean, rstd, {"gamma": gamma, "dgamma": dgamma, "dbeta": dbeta},
                          {"dy": dy, "dx": dx})
        K.layer_norm_backward(x, dy, mean, rstd, self._present(gamma, x), center,
                              dx if dx is not None else np.empty((0, x.shape[1]), x.dtype), dx_beta,
                              self._present(dgamma, x), dgamma_beta, self._present(dbeta, x), dbeta_beta)

    @staticmethod
    def _norm_arrays(where, x, mean, rstd, params, others):
        _float(where, "x", x, ndim=2)
        for name, a in dict(mean=mean, rstd=rstd, **params, **others).items():
            if a is not None:
                check_array(where, name, a, dtype=x.dtype)
        check_layer_norm(where, x, mean, rstd, params, others)

    @staticmethod
    def _present(a, like):
        """An optional vector for the compiled kernels: None becomes an empty one (absent)."""
        return a if a is not None else np.empty(0, like.dtype)

    # -- selections (columns are checked against the layer's width by lamina.Selection.check)
    @staticmethod
    def _selection(where, starts, cols, shared, entries, rows, columns):
        check_array(where, "starts", starts, dtype=np.int32, ndim=1)
        check_array(where, "cols", cols, dtype=np.int32, ndim=1)
        check_selection(where, starts, cols, shared, entries, rows, columns)

    @staticmethod
    def _by_column(where, by_column, entries, rows, columns):
        for name, a in zip(("columns", "bucket_starts", "entries", "entry_rows"), by_column):
            check_array(where, name, a, dtype=np.int32, ndim=1)
        if len(by_column[2]) != entries or len(by_column[3]) != entries:
            raise ValueError(f"{where}: by_column lists {len(by_column[2])} entries and {len(by_column[3])} "
                             f"rows, the values {entries}")
        check_by_column(where, by_column, entries, rows, columns)

    def selected_dots(self, x, w, by_column, out, beta=0.0):
        self._check_selected_dots(x, w, by_column, out)
        _selective.selected_dots(x, w, *by_column, out, beta)

    def _check_selected_dots(self, x, w, by_column, out, where="selected_dots"):
        check_array(where, "x", x, ndim=2)
        _float(where, "x", x)
        check_array(where, "w", w, dtype=x.dtype, ndim=2)
        check_array(where, "out", out, dtype=x.dtype, ndim=1)
        if w.shape[1] != x.shape[1]:
            raise ValueError(f"{where}: w rows of {w.shape[1]} must match x rows of {x.shape[1]}")
        self._by_column(where, by_column, len(out), x.shape[0], w.shape[0])

    def selected_backward(self, g, x, w, by_column, dx=None, dx_beta=0.0, dw=None, dw_beta=0.0):
        self._check_selected_backward(g, x, w, by_column, dx, dw)
        unused = np.empty((1, 1), g.dtype)
        _selective.selected_backward(g, x, w, *by_column, unused if dx is None else dx, dx_beta, dx is not None,
                                     unused if dw is None else dw, dw_beta, dw is not None)

    def selected_dots_in(self, precision, x, w, by_column, out, beta=0.0):
        """In bfloat16: x and the selected rows of w rounded into rows of bfloat16 values (half the
        bytes a dot reads), multiplied by vdpbf16ps where the CPU has AVX512-BF16."""
        if precision != "bfloat16" or x.dtype != np.float32:
            return super().selected_dots_in(precision, x, w, by_column, out, beta)
        self._check_selected_dots(x, w, by_column, out, "selected_dots_in")
        xb, wb = self._bf16_selected_operands("selected_dots_in", x, w, by_column[0])
        _selective.selected_dots_bf16(xb, wb, *by_column, out, beta)

    def selected_backward_in(self, precision, g, x, w, by_column, dx=None, dx_beta=0.0, dw=None, dw_beta=0.0):
        """In bfloat16: the float32 gradient times x and the selected rows of w as rows of bfloat16
        values (as selected_dots_in)."""
        if precision != "bfloat16" or g.dtype != np.float32:
            return super().selected_backward_in(precision, g, x, w, by_column, dx, dx_beta, dw, dw_beta)
        self._check_selected_backward(g, x, w, by_column, dx, dw, "selected_backward_in")
        if dx is None and dw is None:
            return
        xb, wb = self._bf16_selected_operands("selected_backward_in", x, w, by_column[0])
        unused = np.empty((1, 1), g.dtype)
        _selective.selected_backward_bf16(g, xb, wb, *by_column, unused if dx is None else dx, dx_beta,
                                          dx is not None, unused if dw is None else dw, dw_beta, dw is not None)

    def _bf16_selected_operands(self, where, x, w, columns):
        """x's rows and w's rows `columns` (in that order) as rows of bfloat16 values in scratch."""
        width = _selective.bf16_row_values(x.shape[1])
        xb = self.scratch(f"{where} bfloat16 x", (x.shape[0], width), np.uint16)
        wb = self.scratch(f"{where} bfloat16 w", (len(columns), width), np.uint16)
        _selective.round_rows_bf16(np.ascontiguousarray(x), None, xb)
        _selective.round_rows_bf16(np.ascontiguousarray(w), columns, wb)
        return xb, wb

    def _check_selected_backward(self, g, x, w, by_column, dx, dw, where="selected_backward"):
        _float(where, "g", g, ndim=1)
        check_array(where, "x", x, dtype=g.dtype, ndim=2)
        check_array(where, "w", w, dtype=g.dtype, shape=(w.shape[0], x.shape[1]))
        if dx is not None:
            check_array(where, "dx", dx, dtype=g.dtype, shape=x.shape)
        if dw is not None:
            check_array(where, "dw", dw, dtype=g.dtype, shape=w.shape)
        self._by_column(where, by_column, len(g), x.shape[0], w.shape[0])

    def selected_bias_grad(self, g, by_column, db, beta=0.0):
        _float("selected_bias_grad", "g", g, ndim=1)
        check_array("selected_bias_grad", "db", db, dtype=g.dtype, ndim=1)
        self._by_column("selected_bias_grad", by_column, len(g), len(g), db.shape[0])
        columns, bucket, entries, _ = by_column
        _selective.selected_bias_grad(g, columns, bucket, entries, db, beta)

    def add_selected_bias(self, out, b, cols):
        _float("add_selected_bias", "out", out, ndim=1)
        check_array("add_selected_bias", "b", b, dtype=out.dtype, ndim=1)
        check_array("add_selected_bias", "cols", cols, dtype=np.int32, shape=out.shape)
        check_index("add_selected_bias", "cols", cols, b.shape[0])
        _selective.gather_add(b, cols, out)

    def gather_entries(self, full, starts, cols, shared, out, beta=0.0):
        _float("gather_entries", "full", full, ndim=2)
        check_array("gather_entries", "out", out, dtype=full.dtype, ndim=1)
        self._selection("gather_entries", starts, cols, shared, len(out), *full.shape)
        _selective.gather_entries(full, starts, cols, shared, out, beta)

    def scatter_entries(self, g, starts, cols, shared, full):
        _float("scatter_entries", "g", g, ndim=1)
        check_array("scatter_entries", "full", full, dtype=g.dtype, ndim=2)
        self._selection("scatter_entries", starts, cols, shared, len(g), *full.shape)
        _selective.scatter_entries(g, starts, cols, shared, full)

    def _segment_args(self, where, v, starts, pos, w, cost):
        _float(where, "values", v, ndim=1)
        rows = len(starts) - 1
        check_array(where, "starts", starts, dtype=np.int32, ndim=1)
        check_array(where, "pos", pos, dtype=np.int32, shape=(rows,))
        check_array(where, "cost", cost, dtype=v.dtype, shape=(rows,))
        check_offsets(where, "starts", starts, len(v))
        check_positions(where, "pos", pos, starts)
        if w is None:
            return np.empty(0, v.dtype), False
        check_array(where, "w", w, dtype=v.dtype, shape=(rows,))
        return w, True

    def segment_cross_entropy(self, z, starts, pos, shift, w, probs, cost):
        w, weighted = self._segment_args("segment_cross_entropy", z, starts, pos, w, cost)
        _same("segment_cross_entropy", "z", z, probs=probs)
        if shift is not None:
            _same("segment_cross_entropy", "z", z, shift=shift)
        _selective.segment_cross_entropy(z, starts, pos, z if shift is None else shift, shift is not None,
                                         w, weighted, probs, cost)

    def segment_cross_entropy_backward(self, probs, starts, pos, w, dcost, dz, beta=0.0):
        w, weighted = self._segment_args("segment_cross_entropy_backward", probs, starts, pos, w, dcost)
        _same("segment_cross_entropy_backward", "probs", probs, dz=dz)
        _selective.segment_cross_entropy_backward(probs, starts, pos, w, weighted, dcost, dz, beta)

    def segment_self_normalized(self, o, starts, pos, alpha, w, cost):
        w, weighted = self._segment_args("segment_self_normalized", o, starts, pos, w, cost)
        _selective.segment_self_normalized(o, starts, pos, alpha, w, weighted, cost)

    def segment_self_normalized_backward(self, o, starts, pos, alpha, w, dcost, do, beta=0.0):
        w, weighted = self._segment_args("segment_self_normalized_backward", o, starts, pos, w, dcost)
        _same("segment_self_normalized_backward", "o", o, do=do)
        _selective.segment_self_normalized_backward(o, starts, pos, alpha, w, weighted, dcost, do, beta)

    # -- volumes (one sample [C, D, H, W]; geometry = (kernel, stride, padding, dilation, grid),
    #    each a 3-tuple over depth, height, width)
    def _volume(self, where, x, col, geometry, rows):
        _float(where, "volume", x, ndim=4)
        kernel, stride, padding, dilation, grid = geometry
        r0, r1 = rows if rows is not None else (0, grid[0] * grid[1])
        if not 0 <= r0 <= r1 <= grid[0] * grid[1]:
            raise ValueError(f"{where}: window rows {rows} outside the grid's {grid[0] * grid[1]}")
        shape = (x.shape[0] * kernel[0] * kernel[1] * kernel[2], (r1 - r0) * grid[2])
        check_array(where, "col", col, dtype=x.dtype, shape=shape)
        return [*kernel, *stride, *padding, *dilation, *grid, r0, r1]

    def resample_axis(self, x, taps, weights, y):
        self._resampling("resample_axis", ("x", x), taps, weights, ("y", y))
        K.resample_axis(x, taps, weights, y)

    def resample_axis_backward(self, dy, taps, weights, dx, beta=0.0):
        self._resampling("resample_axis_backward", ("dx", dx), taps, weights, ("dy", dy))
        K.resample_axis_backward(dy, taps, weights, dx, beta)

    @staticmethod
    def _resampling(where, inputs, taps, weights, outputs):
        """Check the arrays of a resampling: the input side (name, [outer, n, inner]) and the
        output side (name, [outer, m, inner]) of one float type, taps int32 [m, K] in [0, n),
        weights [m, K] of their type."""
        (src_name, src), (dst_name, dst) = inputs, outputs
        _float(where, src_name, src, ndim=3)
        check_array(where, "taps", taps, dtype=np.int32, ndim=2)
        check_array(where, "weights", weights, dtype=src.dtype, shape=taps.shape)
        check_array(where, dst_name, dst, dtype=src.dtype, shape=(src.shape[0], taps.shape[0], src.shape[2]))
        check_index(where, "taps", taps, src.shape[1])

    def vol2col(self, x, col, geometry, rows=None):
        K.vol2col(x, col, *self._volume("vol2col", x, col, geometry, rows))

    def col2vol(self, col, x, geometry, rows=None):
        K.col2vol(col, x, *self._volume("col2vol", x, col, geometry, rows))

    # -- convolutions: the direct and depth-tap kernels where they apply (cpu/conv_algorithms.py)
    def conv_algorithms(self, geom):
        return conv_algorithms.algorithms(geom)

    def conv_forward(self, geom, weight, ctx, bias=None, activation=None, pool=None):
        if pool is None:
            conv_algorithms.forward(geom, weight, ctx, bias, activation)
        elif not conv_algorithms.forward_pooled(geom, weight, ctx, bias, activation, pool):
            super().conv_forward(geom, weight, ctx, bias, activation, pool)

    def conv_backward(self, geom, weight, ctx):
        if geom.transposed:
            super().conv_backward(geom, weight, ctx)
        else:
            conv_algorithms.backward(geom, weight, ctx)

    # -- the recurrence: the fused kernel where it applies (cpu/fused_recurrence.py)
    packs_recurrent_weights = True

    def recurrence_forward(self, cell, ctx, run):
        if fused_recurrence.fuses_reduced(cell, self, ctx):
            return fused_recurrence.reduced_forward(self, cell, ctx, run)
        fused = fused_recurrence.fuses_in(cell, self, ctx.precision)
        (fused_recurrence.forward if fused else super().recurrence_forward)(cell, ctx, run)

    def recurrence_backward(self, cell, ctx, run):
        fused = fused_recurrence.fuses_in(cell, self, ctx.precision)
        (fused_recurrence.backward if fused else super().recurrence_backward)(cell, ctx, run)

    def sample_threads(self, batch):
        return min(get_num_threads(), batch)

    def channel_bias(self, y, b, beta=1.0):
        _float("channel_bias", "y", y)
        check_array("channel_bias", "b", b, dtype=y.dtype, shape=(y.shape[1],))
        K.channel_bias(y.reshape(y.shape[0], y.shape[1], -1), b, beta)

    def channel_bias_grad(self, dy, db, beta=0.0):
        _float("channel_bias_grad", "dy", dy)
        check_array("channel_bias_grad", "db", db, dtype=dy.dtype, shape=(dy.shape[1],))
        K.channel_bias_grad(dy.reshape(dy.shape[0], dy.shape[1], -1), db, beta)

    # -- pooling: x [N, C, *spatial] seen as planes [N·C, D, H, W]; window = (kernel, stride,
    #    padding), 3-tuples over depth, height, width
    @staticmethod
    def _planes(a):
        return a.reshape((a.shape[0] * a.shape[1],) + (1,) * (5 - a.ndim) + a.shape[2:])

    def max_pool(self, x, out, argmax, window):
        _float("max_pool", "x", x)
        check_array("max_pool", "out", out, dtype=x.dtype, ndim=x.ndim)
        if argmax is not None:
            check_array("max_pool", "argmax", argmax, dtype=np.int32,
                        shape=(out.shape[0] * out.shape[1], int(math.prod(out.shape[2:]))))
        K.max_pool(self._planes(x), self._planes(out), argmax, *(v for part in window_parts(window) for v in part))

    def max_pool_backward(self, dy, argmax, dx, beta=0.0, window=None):
        _float("max_pool_backward", "dy", dy)
        check_array("max_pool_backward", "dx", dx, dtype=dy.dtype, ndim=dy.ndim)
        check_array("max_pool_backward", "argmax", argmax, dtype=np.int32,
                    shape=(dy.shape[0] * dy.shape[1], int(math.prod(dy.shape[2:]))))
        if dx.shape[:2] != dy.shape[:2]:
            raise ValueError(f"max_pool_backward: dx {dx.shape} and dy {dy.shape} must share N and C")
        check_index("max_pool_backward", "argmax", argmax, int(math.prod(dx.shape[2:])))
        K.max_pool_backward(self._planes(dy), argmax, dx.reshape(dx.shape[0] * dx.shape[1], -1), beta)

    def avg_pool(self, x, out, window, count_include_pad=True):
        _float("avg_pool", "x", x)
        check_array("avg_pool", "out", out, dtype=x.dtype, ndim=x.ndim)
        K.avg_pool(self._planes(x), self._planes(out), *(v for part in window_parts(window) for v in part),
                   count_include_pad)

    def avg_pool_backward(self, dy, dx, window, count_include_pad=True, beta=0.0):
        _float("avg_pool_backward", "dy", dy)
        check_array("avg_pool_backward", "dx", dx, dtype=dy.dtype, ndim=dy.ndim)
        K.avg_pool_backward(self._planes(dy), self._planes(dx), *(v for part in window_parts(window) for v in part),
                            count_include_pad, beta)

    # -- batch normalisation: x [N, C, *spatial]; statistics are float64 arrays of C values
    @staticmethod
    def _ncs(a):
        return a.reshape(a.shape[0], a.shape[1], -1)

    def batch_norm_stats(self, x, mean, var):
        _float("batch_norm_stats", "x", x)
        for name, a in (("mean", mean), ("var", var)):
            check_array("batch_norm_stats", name, a, dtype=np.float64, shape=(x.shape[1],))
        K.batch_norm_stats(self._ncs(x), mean, var)

    def batch_norm_apply(self, x, mean, invstd, gamma, beta, y, activation=None):
        _float("batch_norm_apply", "x", x)
        _same("batch_norm_apply", "x", x, y=y)
        affine = gamma is not None
        dummy = np.empty(0, x.dtype)
        relu = activation is not None and activation[0] == "relu"  # in the same pass; others after
        K.batch_norm_apply(self._ncs(x), mean, invstd, gamma if affine else dummy, beta if affine else dummy,
                           affine, self._ncs(y), relu)
        if not relu:
            self.activate_in_place(activation, y)

    def batch_norm_backward(self, x, dy, mean, invstd, gamma, batch_stats, dx, beta, dgamma, dbeta):
        _float("batch_norm_backward", "x", x)
        _same("batch_norm_backward", "x", x, dy=dy)
        affine = gamma is not None
        out = dx if dx is not None else np.empty_like(x)
        K.batch_norm_backward(self._ncs(x), self._ncs(dy), mean, invstd, gamma if affine else np.empty(0, x.dtype),
                              affine, batch_stats, self._ncs(out), beta if dx is not None else 0.0, dgamma, dbeta)

    # -- recurrent cells (one time step; checked by the layer, which owns every buffer)
    def lstm_step(self, g, c_prev, c, h):
        K.lstm_step(g, c if c_prev is None else c_prev, c_prev is not None, c, h)

    def lstm_step_backward(self, g, c_prev, c, dh, dc, dg, dc_prev):
        K.lstm_step_backward(g, c if c_prev is None else c_prev, c_prev is not None, c, dh, dc, dg,
                             dc if dc_prev is None else dc_prev, dc_prev is not None)

    def gru_step(self, g, hh, h_prev, h):
        K.gru_step(g, hh, h if h_prev is None else h_prev, h_prev is not None, h)

    def gru_step_backward(self, g, hh, h_prev, dh, dgx, dgh, dh_prev):
        K.gru_step_backward(g, hh, dh if h_prev is None else h_prev, h_prev is not None, dh, dgx, dgh,
                            dh if dh_prev is None else dh_prev, dh_prev is not None)

    def bernoulli_mask(self, mask, keep, rng):
        _float("bernoulli_mask", "mask", mask)
        if not 0 < keep <= 1:
            raise ValueError(f"bernoulli_mask: keep must be in (0, 1], found {keep}")
        rng.random(dtype=mask.dtype, out=mask)
        # u in [0, 1): floor(u + keep) is 1 with probability keep, else 0
        mask += keep
        np.floor(mask, out=mask)
        mask *= 1.0 / keep

    # -- costs
    def _cost_args(self, where, x, w, cost):
        x2 = _rows(_float(where, "x", x))
        check_array(where, "cost", cost, dtype=x.dtype, shape=(x2.shape[0],))
        if w is None:
            return x2, np.empty(0, x.dtype), False
        check_array(where, "w", w, dtype=x.dtype, shape=(x2.shape[0],))
        return x2, w, True

    def _labels(self, where, labels, rows, classes):
        check_array(where, "labels", labels, dtype=np.int32, shape=(rows,))
        check_index(where, "labels", labels, classes)

    def softmax_cross_entropy(self, x, labels, w, probs, cost):
        x2, w, weighted = self._cost_args("softmax_cross_entropy", x, w, cost)
        self._labels("softmax_cross_entropy", labels, *x2.shape)
        if probs is not None:
            _same("softmax_cross_entropy", "x", x, probs=probs)
        K.softmax_cross_entropy(x2, labels, w, weighted, None if probs is None else _rows(probs), cost)

    def softmax_cross_entropy_backward(self, probs, labels, w, dcost, dx, beta=0.0):
        p2, w, weighted = self._cost_args("softmax_cross_entropy_backward", probs, w, dcost)
        self._labels("softmax_cross_entropy_backward", labels, *p2.shape)
        _same("softmax_cross_entropy_backward", "probs", probs, dx=dx)
        K.softmax_cross_entropy_backward(p2, labels, w, weighted, dcost, _rows(dx), beta)

    def square_error(self, x, t, w, cost):
        x2, w, weighted = self._cost_args("square_error", x, w, cost)
        _same("square_error", "x", x, t=t)
        K.square_error(x2, _rows(t), w, weighted, cost)

    def square_error_backward(self, x, t, w, dcost, dout, wrt_target=False, beta=0.0):
        x2, w, weighted = self._cost_args("square_error_backward", x, w, dcost)
        _same("square_error_backward", "x", x, t=t, dout=dout)
        K.square_error_backward(x2, _rows(t), w, weighted, dcost, _rows(dout), wrt_target, beta)

    # -- optimizer updates
    def sgd_update(self, p, g, v, lr, momentum, dampening, nesterov, weight_decay):
        _float("sgd_update", "p", p)
        _same("sgd_update", "p", p, g=g)
        if momentum:
            _same("sgd_update", "p", p, v=v)
        K.sgd_update(_flat(p), _flat(g), _flat(v if momentum else p), lr, momentum, dampening,
                     nesterov, weight_decay)

    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, weight_decay, decoupled, step):
        _float("adam_update", "p", p)
        _same("adam_update", "p", p, g=g, m=m, v=v)
        if step < 1:
            raise ValueError(f"adam_update: step counts from 1, found {step}")
        K.adam_update(_flat(p), _flat(g), _flat(m), _flat(v), lr, beta1, beta2, eps, weight_decay,
                      decoupled, step)

    def adagrad_update(self, p, g, s, lr, eps, weight_decay):
        _float("adagrad_update", "p", p)
        _same("adagrad_update", "p", p, g=g, s=s)
        K.adagrad_update(_flat(p), _flat(g), _flat(s), lr, eps, weight_decay)

    def rmsprop_update(self, p, g, s, buf, lr, alpha, eps, weight_decay, momentum):
        _float("rmsprop_update", "p", p)
        _same("rmsprop_update", "p", p, g=g, s=s)
        if momentum:
            _same("rmsprop_update", "p", p, buf=buf)
        K.rmsprop_update(_flat(p), _flat(g), _flat(s), _flat(buf if momentum else p), lr, alpha,
                         eps, weight_decay, momentum)
