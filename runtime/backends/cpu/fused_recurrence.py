"""The CPU backend's fused recurrence (pyx/recurrence.h): with lamina's panel-packed W_hh (in
float32 every BLAS provider but MKL, whose packed GEMM runs step by step instead; lamina's int8 and
bfloat16 panels whatever the BLAS), a whole layer direction runs as one compiled call on a team of
threads (team.h) instead of a team of threads woken for every step's GEMM and a cell pass on one
thread.

In bfloat16 or int8 (lamina.precision: inference, or bfloat16 training under Network.autocast) a
layer direction's forward runs as one compiled call too. Where MKL's products serve those
precisions (`reduced_forward`), each step converts or quantizes the previous states, runs MKL's
packed low-precision product (threaded by MKL, called through the function pointers of
_mkl.product_functions) and the cells, with no Python between steps. Where float32 products serve
them, the fused recurrence above runs with W_hh's panels holding its reduced values, each step's
states rounded to bfloat16 or snapped to their rows' u8 grids before the product. With lamina's
int8 panels (CPUBackend.low_precision 'lamina'), each step quantizes the states its member reads
to u8 rows and multiplies them by W_hh's int8 panels (recurrence.h LAMINA_REDUCE_INT8_PANELS); with
its bfloat16 panels (the same, on a CPU with AVX512-BF16), it rounds them to bfloat16 and multiplies
them by W_hh's bfloat16 panels (LAMINA_REDUCE_BF16_PANELS). The backward of bfloat16 training
rounds the rows of dG each member reads and multiplies them by W_hh's bfloat16 panels on such a
CPU, else by float32 panels of W_hh's rounded values.

The threads share the batch by sequences (each runs its own sequences start to end, never
waiting) given at least ROWS_PER_THREAD sequences per thread. With fewer (a lone sequence) they
share it by blocks of hidden units, a barrier per step, where the hidden size is whole panels of
64 bytes and the batch has at least UNITS_MIN_STEPS steps; else it runs on one thread.
FUSED_SHARE forces one way. By sequences needs no barrier and was faster wherever both apply,
even on 8 sequences.
"""

import numpy as np

from .compiled import _kernels
from ...precision import ACTIVATION_LEVELS
from ...threads import free_threads

# the compiled kernels' cell codes, by the layers' cell names
FUSED_CELLS = {"rnn_tanh": 0, "rnn_relu": 1, "lstm": 2, "gru": 3}
# multiply-adds of a direction's recurrent products below which the fused recurrence runs on
# one thread (a barrier per step costs more than it saves on small layers)...
FUSED_PARALLEL_MIN = 1 << 24
# ...unless W_hh takes at least this many bytes: then every step streams it from L3 on one
# thread, and split by units each thread's share stays in its core's L2 from step to step
# (smaller weights stay in one core's L2 anyway, and the barriers make the split slower)
FUSED_PARALLEL_WEIGHT = 512 * 1024
ROWS_PER_THREAD = 4
# Shared by units, a batch of fewer steps than this runs on one thread: each step saves a few
# microseconds, and starting a team whose workers have gone to sleep (team.h) costs as much as
# several steps save
UNITS_MIN_STEPS = 8
FUSED_SHARE = "auto"  # or "rows", "units"
# the compiled kernel's reductions of the recurrent product's left operand (recurrence.h), by the
# precision a float32 pack's values are in (PackedMatrix.operands), and the products of lamina's
# int8 and bfloat16 panels
REDUCE = {"bfloat16": 1, "int8": 2}
INT8_PANELS, BF16_PANELS = 3, 4


def fuses_in(cell, backend, precision):
    """Whether the fused recurrence runs this layer in `precision` on `backend`: where W_hh's pack
    is lamina's panels, whatever the BLAS: its int8 or bfloat16 panels, or (every BLAS but MKL)
    float32 panels, of W_hh or of its reduced values. Never MKL's packs: in float32 the step-by-step
    path runs those, in bfloat16 and int8 reduced_forward."""
    if cell.cell_name not in FUSED_CELLS or not cell.uses_packed(backend):
        return False
    own = (precision == "int8" and backend.low_precision == "lamina") or \
        (precision == "bfloat16" and backend.bf16_panels)
    return own or (backend.blas_name != "mkl" and (precision == "float32" or backend.low_precision != "mkl"))


def fuses_reduced(cell, backend, ctx):
    """Whether `reduced_forward` runs this layer direction: a run in bfloat16 or int8 with MKL's
    low-precision packs (CPUBackend.low_precision 'mkl'), and a cell it has (GRU's reset-first form multiplies by W_hh in two parts: step by step).
    It keeps what the backward reads (activated gates, states, GRU's recurrent products) as the
    step-by-step forward does."""
    return ctx.precision != "float32" and backend.low_precision == "mkl" and cell.cell_name in FUSED_CELLS


def reduced_forward(be, cell, ctx, run):
    """Every step of a direction in one compiled call, W_hh's products in the network's precision."""
    pack = cell.recurrent_pack(ctx, run.sfx, transpose=True)
    order, H = ctx.order, cell.hidden_size
    starts = order.step_starts
    most = _most(ctx)
    n = pack.n
    hh = _hh(cell, ctx, run)
    rows_of = int(starts[-1])
    if pack.provider not in ("mkl-bfloat16", "mkl-int8") or pack.k != H or most > pack.max_rows \
            or run.g.shape != (rows_of, n) or run.hs.shape != (rows_of, H) or hh.shape != (rows_of, n) \
            or (run.cs is not None and run.cs.shape != (rows_of, H)) or np.any(np.diff(starts[1:]) > np.diff(starts[:-1])):
        raise ValueError(f"reduced_forward: a {pack.provider} pack of {pack.k}x{n} for {pack.max_rows} rows does not "
                         f"fit a layer of hidden size {H} over {rows_of} rows, {most} at most per step, in shrinking steps")
    for state in (run.init_h, run.init_c):
        if state is not None and (state.shape[0] < most or state.shape[1] != H):
            raise ValueError(f"reduced_forward: an initial state of shape {state.shape} for {most} sequences of {H}")
    int8 = pack.provider == "mkl-int8"
    b_hh = cell.params["bias_hh" + run.sfx].buffer if cell.cell_name == "gru" and cell.has_bias else None
    one = be.scratch("reduced placeholder", (1, 1), np.float32)
    rows = max(most, 1)
    bits = be.scratch("reduced bits", (rows, H) if not int8 else (1, 1), np.uint16)
    u = be.scratch("reduced u8", (rows, H) if int8 else (1, 1), np.uint8)
    row_scales = be.scratch("reduced row scales", (rows,), np.float32)
    zeros = be.scratch("reduced zero points", (rows,), np.int32)
    sums = be.scratch("reduced sums", (rows, n) if int8 else (1, 1), np.int32)
    col_scales = pack.scales if int8 else row_scales
    col_sums = pack.sums if int8 else zeros
    bf16_product, u8s8_product = be._mkl.product_functions()
    _kernels.recurrence_forward_reduced(
        FUSED_CELLS[cell.cell_name], starts, run.g, pack.handle.address, n, pack.handle.alpha,
        u8s8_product if int8 else bf16_product, int8, col_scales, col_sums, be.int8_activation_levels if int8 else 0,
        hh, *_given(b_hh, row_scales), run.hs, *_given(run.cs, one), *_given(run.init_h, one),
        *_given(run.init_c, one), bits, u, row_scales, zeros, sums)
    out, index, col = run.output
    be.scatter_rows(run.hs, index, out, col=col)


def _share(cell, ctx, g):
    """(threads, by_rows) for the fused recurrence: threads is the team's size."""
    large = (g.shape[0] * g.shape[1] * cell.hidden_size >= FUSED_PARALLEL_MIN
             or g.shape[1] * cell.hidden_size * g.dtype.itemsize >= FUSED_PARALLEL_WEIGHT)
    threads = free_threads() if large else 1
    share = FUSED_SHARE
    if share == "auto":
        whole_panels = cell.hidden_size * g.dtype.itemsize % 64 == 0
        few = ctx.order.num_sequences < ROWS_PER_THREAD * threads
        share = "units" if few and whole_panels else "rows"
    if share == "rows" and ctx.order.num_sequences < ROWS_PER_THREAD * threads:
        threads = 1
    if share == "units" and FUSED_SHARE == "auto" and len(ctx.order.step_starts) - 1 < UNITS_MIN_STEPS:
        threads = 1
    by_rows = share == "rows"
    return _kernels.recurrence_threads(threads, by_rows, cell.hidden_size, ctx.order.step_starts,
                                       g.dtype.itemsize), by_rows


def _given(a, placeholder):
    """(array, present) for the fused kernels' optional arguments: an absent one passes a
    placeholder of the right kind, never read."""
    return (a, True) if a is not None else (placeholder, False)


def _hh(cell, ctx, run):
    """The GRU's recurrent products (the kernels keep them for backward); g for the others."""
    return cell.workspace(ctx, "hh", run.l, run.d, 3 * cell.hidden_size) if cell.cell_name == "gru" else run.g


def forward(cell, ctx, run):
    """Every step on a compiled team (G arrives with the input bias already added by the layer's
    input projection; GRU's b_hh joins the recurrent product); the output rows are written as the
    cells finish."""
    pack = cell.recurrent_pack(ctx, run.sfx, transpose=True)
    own = pack.provider in ("int8-panels", "bf16-panels")  # (a product of that precision itself)
    # (int8 or bfloat16 panels: a placeholder for the float panels; theirs go apart)
    panels = ctx.be.scratch("panels placeholder", (1,), np.float32) if own else pack.panels
    b_hh = cell.params["bias_hh" + run.sfx].buffer if cell.cell_name == "gru" and cell.has_bias else None
    args = (FUSED_CELLS[cell.cell_name], ctx.order.step_starts, run.g, _hh(cell, ctx, run),
            *_given(b_hh, panels), panels, run.hs, *_given(run.cs, run.hs), *_given(run.init_h, run.hs),
            *_given(run.init_c, run.hs), *run.output)
    threads, by_rows = _share(cell, ctx, run.g)
    if pack.provider == "int8-panels":  # each member quantizes the states its product reads into its own scratch
        scratch = ctx.be.scratch("int8 states", (threads * _kernels.int8_state_bytes(_most(ctx), cell.hidden_size),),
                                 np.uint8)
        return _kernels.recurrence_forward(*args, threads, by_rows, INT8_PANELS, _kernels.INT8_LEVELS, None,
                                           (pack.panels, pack.scales, pack.sums, scratch))
    if pack.provider == "bf16-panels":  # each member rounds the states its product reads into its own scratch
        scratch = ctx.be.scratch("bfloat16 states",
                                 (threads * _kernels.bf16_state_bytes(_most(ctx), cell.hidden_size),), np.uint8)
        return _kernels.recurrence_forward(*args, threads, by_rows, BF16_PANELS, 0, None, (pack.panels, scratch))
    if pack.operands is None:
        return _kernels.recurrence_forward(*args, threads, by_rows)
    # bfloat16 or int8 in float32 products: each member reduces the previous states its product
    # reads into its own scratch
    reduced = ctx.be.scratch("reduced states", (threads, _most(ctx), cell.hidden_size), np.float32)
    _kernels.recurrence_forward(*args, threads, by_rows, REDUCE[pack.operands], ACTIVATION_LEVELS, reduced)


def backward(cell, ctx, run):
    # (bfloat16 training: W_hh's bfloat16 panels where the CPU multiplies in bfloat16, else float32
    # panels of its rounded values, whatever the forward multiplies by)
    own = ctx.precision == "bfloat16" and ctx.be.bf16_panels
    pack = cell.recurrent_pack(ctx, run.sfx, transpose=False,
                               method="pack" if ctx.precision == "float32" or own else "pack_reduced")
    panels = ctx.be.scratch("panels placeholder", (1,), np.float32) if own else pack.panels
    has_cell = run.cs is not None
    args = (FUSED_CELLS[cell.cell_name], ctx.order.step_starts, run.g, _hh(cell, ctx, run), run.hs,
            run.cs if has_cell else run.hs, run.dhs, run.dcs if has_cell else run.hs, has_cell, run.dg, run.dgh, panels,
            *_given(run.init_h, run.hs), *_given(run.init_c, run.hs), *_given(run.dh0, run.hs),
            *_given(run.dc0, run.hs))
    threads, by_rows = _share(cell, ctx, run.g)
    if own:  # each member rounds the rows of dG its product reads into its own scratch
        scratch = ctx.be.scratch("bfloat16 gradients",
                                 (threads * _kernels.bf16_state_bytes(_most(ctx), run.g.shape[1]),), np.uint8)
        return _kernels.recurrence_backward(*args, threads, by_rows, BF16_PANELS, None, (pack.panels, scratch))
    if pack.operands is None:
        return _kernels.recurrence_backward(*args, threads, by_rows)
    # (bfloat16 training: each member rounds the rows of dG its product reads)
    reduced = ctx.be.scratch("reduced gradients", (threads, _most(ctx), run.g.shape[1]), np.float32)
    _kernels.recurrence_backward(*args, threads, by_rows, REDUCE[pack.operands], reduced)


def _most(ctx):
    """The rows of a step at most (the first step's)."""
    starts = ctx.order.step_starts
    return int(starts[1] - starts[0]) if len(starts) > 1 else 0
