"""The CPU backend's fused recurrence (pyx/recurrence.h): with lamina's panel-packed W_hh (every
BLAS provider but MKL, whose packed GEMM runs step by step instead), a whole layer direction runs
as one compiled call on a team of threads (team.h) instead of a team of threads woken for every
step's GEMM and a cell pass on one thread.

The threads share the batch by sequences (each runs its own sequences start to end, never
waiting) given at least ROWS_PER_THREAD sequences per thread. With fewer (a lone sequence) they
share it by blocks of hidden units, a barrier per step, where the hidden size is whole panels of
64 bytes and the batch has at least UNITS_MIN_STEPS steps; else it runs on one thread.
FUSED_SHARE forces one way. By sequences needs no barrier and was faster wherever both apply,
even on 8 sequences.
"""

from .compiled import _kernels
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


def fuses(cell, backend):
    """Whether the fused recurrence runs this layer on `backend`."""
    return cell.cell_name in FUSED_CELLS and cell.uses_packed(backend) and backend.blas_name != "mkl"


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
    panels = cell.recurrent_pack(ctx, run.sfx, transpose=True).panels
    b_hh = cell.params["bias_hh" + run.sfx].buffer if cell.cell_name == "gru" and cell.has_bias else None
    args = (FUSED_CELLS[cell.cell_name], ctx.order.step_starts, run.g, panels, False, _hh(cell, ctx, run),
            *_given(b_hh, panels), panels, run.hs, *_given(run.cs, run.hs), *_given(run.init_h, run.hs),
            *_given(run.init_c, run.hs), *run.output)
    _kernels.recurrence_forward(*args, *_share(cell, ctx, run.g))


def backward(cell, ctx, run):
    panels = cell.recurrent_pack(ctx, run.sfx, transpose=False).panels
    has_cell = run.cs is not None
    args = (FUSED_CELLS[cell.cell_name], ctx.order.step_starts, run.g, _hh(cell, ctx, run), run.hs,
            run.cs if has_cell else run.hs, run.dhs, run.dcs if has_cell else run.hs, has_cell, run.dg, run.dgh, panels,
            *_given(run.init_h, run.hs), *_given(run.init_c, run.hs), *_given(run.dh0, run.hs),
            *_given(run.dc0, run.hs))
    _kernels.recurrence_backward(*args, *_share(cell, ctx, run.g))
