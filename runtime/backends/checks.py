"""Range checks of index arguments, shared by every backend.

Compiled kernels dereference ids, labels, row lists, offsets and argmax positions without bounds
checks, so every backend checks them here, at its boundary, on the host array the kernel will
read (a device backend checks the host copy it uploads; its kernels also guard the indices they
read from device memory). The errors say which kernel, which argument, the valid range, the
value found and where.
"""
import numpy as np

from ..errors import IndexRangeError


def _numpy_range(ids):
    return ids.min(), ids.max()


_index_range = _numpy_range  # (smallest, largest) of a C-contiguous 1-D int32 array


def register_index_range(fn):
    """Use fn(ids) -> (smallest, largest), one pass over a C-contiguous 1-D int32 array, in
    check_index (a compiled backend gives its own; numpy's min and max read the array twice)."""
    global _index_range
    _index_range = fn


def gemm_sizes(where, a, b, c, trans_a, trans_b):
    """(m, n, k) of c = op(a) op(b), or a ValueError naming the shapes that do not fit."""
    m, k = (a.shape[1], a.shape[0]) if trans_a else a.shape
    kb, n = (b.shape[1], b.shape[0]) if trans_b else b.shape
    if k != kb or c.shape != (m, n):
        raise ValueError(f"{where}: op(a) is {m}x{k} and op(b) is {kb}x{n}, so c must be {m}x{n} with equal inner "
                         f"sizes; found a {a.shape}{' transposed' if trans_a else ''}, b {b.shape}"
                         f"{' transposed' if trans_b else ''}, c {c.shape}")
    return m, n, k


def select_sizes(cond, a, b, out):
    """(a's size, b's size) for Backend.select, or a ValueError naming the array that does not fit:
    cond has out's shape, a and b out's size or one row's."""
    row = out.size // out.shape[0] if out.ndim and out.shape[0] else out.size
    if tuple(cond.shape) != tuple(out.shape):
        raise ValueError(f"select: cond must have out's shape {tuple(out.shape)}, found {tuple(cond.shape)}")
    for name, x in (("a", a), ("b", b)):
        if x.size not in (out.size, row) or x.dtype != out.dtype:
            raise ValueError(f"select: {name} must be {out.dtype} of out's size {out.size} or one row's ({row}), "
                             f"found {x.dtype} of size {x.size}")
    return a.size, b.size


def select_on_host(cond, a, b, out):
    """Backend.select on numpy arrays (the CPU's and the reference's), sizes checked."""
    select_sizes(cond, a, b, out)
    rows = out.shape[0] if out.ndim else 1
    flat = out.reshape(rows, -1)
    np.copyto(flat, b.reshape(-1 if b.size == out.size else 1, flat.shape[1]))
    np.copyto(flat, a.reshape(-1 if a.size == out.size else 1, flat.shape[1]), where=cond.reshape(rows, -1) > 0)


def check_index(where, name, ids, bound, low=0):
    """Every entry of the integer array `ids` lies in [low, bound)."""
    ids = np.asarray(ids)
    if ids.size == 0:
        return
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{where}: {name} must hold integers, found {ids.dtype}")
    if ids.dtype == np.int32 and ids.ndim == 1 and ids.flags.c_contiguous:
        smallest, largest = _index_range(ids)
    else:
        smallest, largest = ids.min(), ids.max()
    if smallest < low or largest >= bound:
        flat = ids.reshape(-1)
        at = int(np.flatnonzero((flat < low) | (flat >= bound))[0])
        raise IndexRangeError(f"{where}: {name} must lie in [{low}, {bound}), found {flat[at]} at "
                              f"position {at}")


def check_offsets(where, name, starts, total):
    """`starts` is a non-decreasing offset list from 0 to `total` (a batch's sequences, a
    selection's rows, a bucket list)."""
    starts = np.asarray(starts)
    if starts.ndim != 1 or len(starts) < 1:
        raise IndexRangeError(f"{where}: {name} must be a 1-D offset list, found shape {starts.shape}")
    if starts[0] != 0 or starts[-1] != total:
        raise IndexRangeError(f"{where}: {name} must run from 0 to {total}, found {starts[0]} .. {starts[-1]}")
    steps = np.diff(starts)
    if len(steps) and steps.min() < 0:
        at = int(np.flatnonzero(steps < 0)[0])
        raise IndexRangeError(f"{where}: {name} must not decrease, found {starts[at]} then {starts[at + 1]} "
                              f"at position {at}")


def check_positions(where, name, pos, starts):
    """Each row i's position pos[i] lies among its own entries [starts[i], starts[i + 1])."""
    pos = np.asarray(pos)
    bad = (pos < starts[:-1]) | (pos >= starts[1:])
    if bad.any():
        at = int(np.flatnonzero(bad)[0])
        raise IndexRangeError(f"{where}: {name}[{at}] must lie in row {at}'s entries "
                              f"[{starts[at]}, {starts[at + 1]}), found {pos[at]}")


def check_selection(where, starts, cols, shared, entries, rows, columns):
    """A selection (row offsets `starts`, column ids `cols`, shared by every row or listed per
    entry) describes `entries` values over a [rows, columns] array."""
    if len(starts) != rows + 1:
        raise IndexRangeError(f"{where}: starts must hold rows + 1 = {rows + 1} offsets, found {len(starts)}")
    check_offsets(where, "starts", starts, entries)
    if shared and entries != rows * len(cols):
        raise IndexRangeError(f"{where}: a shared selection of {len(cols)} columns over {rows} rows has "
                              f"{rows * len(cols)} entries, the values {entries}")
    if not shared and len(cols) != entries:
        raise IndexRangeError(f"{where}: the selection lists {len(cols)} columns for {entries} entries")
    check_index(where, "cols", cols, columns)


def check_by_column(where, by_column, entries, rows, columns):
    """A selection grouped by column (columns, bucket_starts, entries, entry_rows) indexes
    `entries` values, `rows` input rows and `columns` weight rows."""
    cols, bucket, entry_ids, entry_rows = by_column
    check_index(where, "by_column columns", cols, columns)
    check_offsets(where, "by_column bucket_starts", bucket, len(entry_ids))
    if len(bucket) != len(cols) + 1:
        raise IndexRangeError(f"{where}: by_column bucket_starts must hold {len(cols) + 1} offsets, "
                              f"found {len(bucket)}")
    check_index(where, "by_column entries", entry_ids, entries)
    check_index(where, "by_column entry_rows", entry_rows, rows)


def check_attention(where, qkv, starts, heads, out, lse, **others):
    """The shapes of an attention kernel's arrays (Backend.attention): qkv [rows, 3E], out and
    the arrays in `others` [rows, E] or [rows, 3E] as named, lse [rows, heads], E a multiple of
    heads, and the offsets of the rows."""
    rows, E = out.shape if len(out.shape) == 2 else (None, None)
    if E is None or heads < 1 or E % heads:
        raise ValueError(f"{where}: out must be [rows, E] with E a multiple of heads={heads}, found {out.shape}")
    expected = {"qkv": (qkv, (rows, 3 * E)), "lse": (lse, (rows, heads))}
    expected.update({name: (a, (rows, 3 * E if name.endswith("qkv") else E)) for name, a in others.items()})
    for name, (a, shape) in expected.items():
        if tuple(a.shape) != shape:
            raise ValueError(f"{where}: {name} must have shape {shape} (out is {tuple(out.shape)}, heads={heads}), "
                             f"found {tuple(a.shape)}")
        if a.dtype != out.dtype:
            raise TypeError(f"{where}: {name} must be {out.dtype} like out, found {a.dtype}")
    check_offsets(where, "starts", starts, rows)


def check_layer_norm(where, x, mean, rstd, params, others):
    """The shapes of a layer-norm kernel's arrays: x [rows, C], mean and rstd [rows], each of
    `params` [C] or None, each of `others` like x or None."""
    if len(x.shape) != 2:
        raise ValueError(f"{where}: x must be [rows, C], found {tuple(x.shape)}")
    rows, C = x.shape
    for name, a, shape in ([("mean", mean, (rows,)), ("rstd", rstd, (rows,))] +
                           [(n, a, (C,)) for n, a in params.items()] + [(n, a, (rows, C)) for n, a in others.items()]):
        if a is None:
            continue
        if tuple(a.shape) != shape:
            raise ValueError(f"{where}: {name} must have shape {shape} (x is {tuple(x.shape)}), found {tuple(a.shape)}")
        if a.dtype != x.dtype:
            raise TypeError(f"{where}: {name} must be {x.dtype} like x, found {a.dtype}")
