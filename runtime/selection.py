"""Selections: which output columns a selective fully-connected layer computes for one batch.

Two forms, fed to a network input declared with `net.input("cols", dtype="selection")`:
- shared: one list of column ids that every row scores; the layer's output is dense [rows, k];
- per row (CSR): int32 row offsets `starts` [rows + 1] and column ids, any count per row; the
  layer's output is one value per selected (row, column) with the same offsets.

Each selected (row, column) is an *entry*; a row's entries are contiguous and in the order given.
Every row selects at least one column (a softmax over nothing has no meaning). A row may select a
column twice: both entries are scored (and both count in a softmax over the row); a label's
position is its first entry.

`logq` (optional, one float per entry, or per column of a shared list) is the log of the
expected count of each entry's column among the samples that built the selection. Costs subtract
it from the scores (the sampled-softmax correction); inference ignores it.

A Selection is immutable: it is checked once per layer width and its per-column grouping is
cached, and kernels index weights with its ids, so its arrays are frozen copies (read-only views
of bytes objects, which numpy cannot make writeable again) and the attributes have no setters.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

from .errors import InputError
from .sequence import SequenceError, Sequences, _check_starts


def frozen(a):
    """A read-only copy of `a` that cannot be made writeable again (its memory is a bytes object)."""
    a = np.ascontiguousarray(a)
    return np.frombuffer(a.tobytes(), dtype=a.dtype).reshape(a.shape)


def group_by_column(starts, cols):
    """A per-row selection's entries grouped by column (CSR to CSC by a stable sort): (columns,
    bucket_starts, entries, entry_rows) as Selection.by_column describes them. Column ids below
    2^16 (a vocabulary's) sort as 16-bit keys, which numpy's stable sort orders by radix in
    linear time; the buckets start where the sorted ids change."""
    small = len(cols) and 0 <= cols.min() and cols.max() < 1 << 16
    entries = np.argsort(cols.astype(np.uint16) if small else cols, kind="stable").astype(np.int32)
    entry_rows = np.repeat(np.arange(len(starts) - 1, dtype=np.int32), np.diff(starts))[entries]
    ordered = cols[entries]
    first = np.flatnonzero(np.diff(ordered)) + 1
    if len(ordered):
        first = np.concatenate([[0], first])
    bucket_starts = np.append(first, len(cols)).astype(np.int32)
    return ordered[first].astype(np.int32), bucket_starts, entries, entry_rows


def first_label_entries(starts, cols, shared, labels):
    """pos[i] = the first entry of row i whose column is labels[i], or -1 where row i does not
    select it; a shared selection's rows all select cols."""
    rows, k = len(labels), len(cols)
    if shared:
        hit = cols[None, :] == labels[:, None]
        first = np.argmax(hit, axis=1)
        return np.where(hit.any(axis=1), np.arange(rows) * k + first, -1).astype(np.int32)
    entry_rows = np.repeat(np.arange(rows), np.diff(starts))
    hits = np.flatnonzero(cols == labels[entry_rows])
    first = np.full(rows, len(cols))
    np.minimum.at(first, entry_rows[hits], hits)
    return np.where(first < len(cols), first, -1).astype(np.int32)


class Selection:
    """The columns a selective layer scores for one batch (see the module docstring)."""

    def __init__(self, columns, starts=None, logq=None):
        columns = np.asarray(columns)
        if columns.dtype != np.int32:
            raise InputError(f"Selection: column ids must be int32, found {columns.dtype}")
        if columns.ndim != 1 or len(columns) == 0:
            raise InputError(f"Selection: column ids must be a non-empty 1-D array, found shape {columns.shape}")
        self._columns = frozen(columns)  # the caches below and the kernels rely on it
        if starts is not None:
            try:
                starts = _check_starts(starts, len(columns), "Selection")
            except SequenceError as e:
                raise InputError(str(e).replace("sequence", "row")) from None
            starts = frozen(starts)
        self._starts = starts
        if logq is not None:
            logq = np.asarray(logq, dtype=np.float64)
            if logq.shape != columns.shape:
                raise InputError(f"Selection: logq must hold one value per column id {columns.shape}, "
                                 f"found {logq.shape}")
            logq = frozen(logq)
        self._logq = logq
        self._cache = {}

    @property
    def columns(self):
        """The column ids (int32, read-only)."""
        return self._columns

    @property
    def logq(self):
        """log expected counts per entry (float64, read-only), or None."""
        return self._logq

    @classmethod
    def shared(cls, columns: Any, logq: Any = None) -> Selection:
        """Every row scores the same columns."""
        return cls(columns, None, logq)

    @classmethod
    def per_row(cls, starts: Any, columns: Any, logq: Any = None) -> Selection:
        """CSR: row i scores columns[starts[i]:starts[i + 1]]."""
        return cls(columns, starts, logq)

    @classmethod
    def from_lists(cls, lists: Sequence[Any], logq: Optional[Sequence[Any]] = None) -> Selection:
        """One array of column ids per row."""
        if not len(lists):
            raise InputError("Selection.from_lists: expected at least one row, found none")
        starts = np.zeros(len(lists) + 1, np.int32)
        np.cumsum([len(c) for c in lists], out=starts[1:])
        columns = np.concatenate([np.asarray(c, np.int32).reshape(-1) for c in lists])
        return cls(columns, starts, None if logq is None else np.concatenate(logq))

    @property
    def is_shared(self):
        return self._starts is None

    @property
    def width(self):
        """Columns per row of a shared selection."""
        return len(self.columns) if self.is_shared else None

    def __repr__(self):
        if self.is_shared:
            return f"Selection.shared({len(self.columns)} columns)"
        return f"Selection.per_row({len(self._starts) - 1} rows, {len(self.columns)} entries)"

    def num_rows(self):
        """Rows of a per-row selection (None for a shared one: it fits any batch)."""
        return None if self.is_shared else len(self._starts) - 1

    def starts(self, rows):
        """The entry offsets [rows + 1] over a batch of `rows` rows."""
        if not self.is_shared:
            return self._starts
        key = ("starts", rows)
        if key not in self._cache:
            self._cache[key] = frozen(np.arange(rows + 1, dtype=np.int32) * np.int32(len(self.columns)))
        return self._cache[key]

    def num_entries(self, rows):
        return rows * len(self.columns) if self.is_shared else len(self.columns)

    def check(self, rows, out_features, where):
        """Raise InputError unless this selection fits `rows` rows of a layer with
        `out_features` columns."""
        key = ("checked", rows, out_features)
        if key in self._cache:
            return
        if not self.is_shared and len(self._starts) - 1 != rows:
            raise InputError(f"{where}: the selection has {len(self._starts) - 1} rows, the input has {rows}")
        c = self.columns
        if c.min() < 0 or c.max() >= out_features:
            bad = c[(c < 0) | (c >= out_features)][0]
            raise InputError(f"{where}: selected column ids must lie in [0, {out_features}), found {bad}")
        self._cache[key] = True

    def by_column(self, out_features):
        """The entries of a per-row selection grouped by column (CSC), computed once:
        (columns, bucket_starts, entries, entry_rows): the distinct selected columns in increasing
        order; column columns[u] holds the entries entries[bucket_starts[u]:bucket_starts[u + 1]]
        (in increasing order), and entry_rows gives each of those entries' row."""
        key = ("by_column", out_features)
        if key not in self._cache:
            self._cache[key] = tuple(frozen(a) for a in group_by_column(self._starts, self.columns))
        return self._cache[key]

    def distinct(self):
        """A shared selection's distinct columns (sorted) and, per column id, its index there."""
        if "distinct" not in self._cache:
            self._cache["distinct"] = tuple(frozen(a.astype(np.int32)) for a in
                                            np.unique(self.columns, return_inverse=True))
        return self._cache["distinct"]

    def entry_logq(self, rows, dtype):
        """logq per entry over `rows` rows (None without logq)."""
        if self.logq is None:
            return None
        key = ("logq", rows, np.dtype(dtype))
        if key not in self._cache:
            per = np.tile(self.logq, rows) if self.is_shared else self.logq
            self._cache[key] = frozen(np.asarray(per, dtype=dtype))
        return self._cache[key]

    def label_entries(self, labels):
        """For each row's label (int32 [rows]), the index of its first entry with that column;
        a label its row does not select is an InputError naming the row."""
        rows = len(labels)
        key = ("labels", labels.tobytes())
        if key in self._cache:
            return self._cache[key]
        pos = first_label_entries(self.starts(rows), self.columns, self.is_shared, np.asarray(labels, np.int32))
        missing = int(np.argmax(pos < 0)) if (pos < 0).any() else -1
        if missing >= 0:
            raise InputError(f"row {missing}: its label {labels[missing]} is not among the row's selected "
                             f"columns; a selection must include every row's label")
        pos = frozen(pos)
        self._cache = {k: v for k, v in self._cache.items() if k[0] != "labels"}
        self._cache[key] = pos
        return pos

    def unpack(self, values, rows):
        """A layer's output values for this selection as the user sees them: [rows, k] for a
        shared selection, else a lamina.Sequences with the selection's row offsets."""
        if self.is_shared:
            return values.reshape(rows, len(self.columns))
        return Sequences(values, self._starts.copy())


def _log_uniform(num_classes):
    """Log-uniform (Zipf) probabilities over class ids sorted by falling frequency:
    P(c) = log((c + 2) / (c + 1)) / log(num_classes + 1)."""
    c = np.arange(num_classes, dtype=np.float64)
    return np.log((c + 2) / (c + 1)) / np.log(num_classes + 1)


def sampled_selection(labels: np.ndarray, num_classes: int, num_sampled: int, distribution: str = "uniform",
                      shared_negatives: bool = False, rng: Optional[np.random.Generator] = None,
                      row_generators: Optional[Sequence[tuple[int, np.random.Generator]]] = None) -> Selection:
    """A per-row selection for sampled-softmax training: row i selects its label, then
    `num_sampled` negatives drawn with replacement from `distribution` ('uniform' or
    'log_uniform', the Zipf law of class ids sorted by frequency), per row or, with
    shared_negatives, once for the whole batch. logq holds log(num_sampled * Q(c)) for every
    entry, so the cost computes the corrected logits z - log(expected count) (Jean et al. 2015);
    a negative that equals its row's label (an accidental hit) gets logq = +inf, which removes
    it from the row's softmax. `row_generators`: (rows, generator) pairs, in order, covering
    every row: each group of rows draws its negatives from its own generator (a sample's draws
    then do not depend on which batch or process it is in); else every draw comes from `rng`."""
    labels = np.asarray(labels)
    if labels.dtype != np.int32 or labels.ndim != 1 or len(labels) == 0:
        raise InputError(f"sampled_selection: labels must be a non-empty 1-D int32 array, found "
                         f"{labels.dtype} {labels.shape}")
    if labels.min() < 0 or labels.max() >= num_classes:
        raise InputError(f"sampled_selection: labels must lie in [0, {num_classes})")
    if num_sampled < 1:
        raise InputError(f"sampled_selection: num_sampled must be at least 1, found {num_sampled}")
    rng = rng if rng is not None else np.random.default_rng()
    rows = len(labels)
    if distribution == "uniform":
        q = None
        draw = lambda g, size: g.integers(0, num_classes, size=size)
    elif distribution == "log_uniform":
        q = _log_uniform(num_classes)
        # inverse CDF: CDF(c) = log(c + 2) / log(n + 1), so c = floor(exp(u log(n + 1))) - 1
        draw = lambda g, size: np.minimum(np.floor(np.exp(g.random(size) * np.log(num_classes + 1))) - 1,
                                          num_classes - 1).astype(np.int64)
    else:
        raise InputError(f"sampled_selection: distribution must be 'uniform' or 'log_uniform', "
                         f"found {distribution!r}")
    if shared_negatives or row_generators is None:
        negatives = draw(rng, (1 if shared_negatives else rows, num_sampled))
    else:
        if sum(n for n, _ in row_generators) != rows:
            raise InputError(f"sampled_selection: row_generators cover {sum(n for n, _ in row_generators)} rows, "
                             f"the labels {rows}")
        negatives = np.concatenate([draw(g, (n, num_sampled)) for n, g in row_generators])
    negatives = np.broadcast_to(negatives, (rows, num_sampled))
    columns = np.concatenate([labels[:, None], negatives], axis=1).astype(np.int32)
    qs = np.full(columns.shape, 1.0 / num_classes) if q is None else q[columns]
    logq = np.log(num_sampled * qs)
    logq[:, 1:][negatives == labels[:, None]] = np.inf
    starts = np.arange(rows + 1, dtype=np.int32) * np.int32(num_sampled + 1)
    return Selection.per_row(starts, columns.reshape(-1), logq.reshape(-1))


def top_k(scores: Any, k: int, selection: Optional[Selection] = None) -> tuple[np.ndarray, np.ndarray]:
    """The k best columns of each row: (ids int32 [rows, k], scores [rows, k]), best first.
    `scores` is a selective layer's output for `selection` ([rows, width] for a shared one, a
    Sequences for a per-row one), or a full [rows, classes] output without a selection. A row
    with fewer than k entries pads with id -1 and score -inf."""
    if isinstance(scores, Sequences):
        starts, values = scores.starts, scores.values
        rows = len(starts) - 1
        width = int(np.diff(starts).max())
        dense = np.full((rows, width), -np.inf, values.dtype)
        row_of = np.repeat(np.arange(rows), np.diff(starts))
        slot = np.arange(len(values)) - starts[row_of]
        dense[row_of, slot] = values
        if selection is None:
            raise InputError("top_k: per-row scores need their selection to name the columns")
        ids = np.full((rows, width), -1, np.int32)
        ids[row_of, slot] = selection.columns
    else:
        dense = np.asarray(scores)
        if dense.ndim != 2:
            raise InputError(f"top_k: scores must be [rows, columns] or a Sequences, found shape {dense.shape}")
        cols = selection.columns if selection is not None else np.arange(dense.shape[1], dtype=np.int32)
        ids = np.broadcast_to(cols, dense.shape)
    k = int(k)
    if k < 1:
        raise InputError(f"top_k: k must be at least 1, found {k}")
    take = min(k, dense.shape[1])
    part = np.argpartition(-dense, take - 1, axis=1)[:, :take] if take < dense.shape[1] else \
        np.broadcast_to(np.arange(take), (dense.shape[0], take))
    top = np.take_along_axis(dense, part, 1)
    order = np.argsort(-top, axis=1, kind="stable")
    best = np.take_along_axis(part, order, 1)
    out_scores = np.take_along_axis(dense, best, 1)
    out_ids = np.take_along_axis(ids, best, 1).astype(np.int32)
    if take < k:
        out_ids = np.pad(out_ids, ((0, 0), (0, k - take)), constant_values=-1)
        out_scores = np.pad(out_scores, ((0, 0), (0, k - take)), constant_values=-np.inf)
    out_ids[np.isneginf(out_scores)] = -1
    return out_ids, out_scores
