"""Variable-length sequence batches and their time-major batch order.

A batch of sequences travels packed: `values` [total_steps, *features] holds every sequence's
rows one after another, and int32 `starts` [num_sequences + 1] says where each begins (as in
Paddle's Argument and PyTorch's PackedSequence, but in the input order). Nothing pads.

Empty sequences are rejected: a zero-length sequence has no last state and no rows to pool, and
every consumer would need a special case; drop empty sequences before batching.

Recurrent layers walk a batch in time-major order (BatchOrder): sequences sorted by length,
longest first, ties in input order; step t holds the rows of every sequence longer than t, in that
sorted order. So step t is one contiguous block, and its rows' previous states are the first rows
of step t-1.
"""
from __future__ import annotations

import functools
from typing import Any, Sequence

import numpy as np

from .errors import SequenceError


def _check_starts(starts, total, where="Sequences"):
    starts = np.asarray(starts)
    if starts.dtype != np.int32:
        raise SequenceError(f"{where}: starts must be int32, found {starts.dtype}")
    if starts.ndim != 1 or len(starts) < 2:
        raise SequenceError(f"{where}: starts must be a 1-D array of num_sequences + 1 offsets "
                            f"(at least 2), found shape {starts.shape}")
    if starts[0] != 0:
        raise SequenceError(f"{where}: starts must begin at 0, found {starts[0]}")
    lengths = np.diff(starts)
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise SequenceError(f"{where}: starts must not decrease, found starts[{i}]={starts[i]} > "
                            f"starts[{i + 1}]={starts[i + 1]}")
    if (lengths == 0).any():
        i = int(np.argmax(lengths == 0))
        raise SequenceError(f"{where}: sequence {i} is empty (starts[{i}] == starts[{i + 1}] == {starts[i]}); "
                            f"lamina does not take empty sequences, drop them before batching")
    if starts[-1] != total:
        raise SequenceError(f"{where}: starts must end at the number of rows, {total}, found {starts[-1]}")
    return starts


class Sequences:
    """A batch of variable-length sequences: `values` [total_steps, *features] and int32
    `starts` [num_sequences + 1]."""

    def __init__(self, values: np.ndarray, starts: Any) -> None:
        if not isinstance(values, np.ndarray):
            raise SequenceError(f"Sequences: values must be a numpy array, found {type(values).__name__}")
        if values.ndim < 1:
            raise SequenceError("Sequences: values must have a leading axis of rows")
        self.values = values
        self.starts = _check_starts(starts, values.shape[0])

    @classmethod
    def unchecked(cls, values, starts):
        """Sequences over offsets already checked against these rows (a run's outputs have its
        input's offsets): no second check."""
        seqs = cls.__new__(cls)
        seqs.values, seqs.starts = values, starts
        return seqs

    @classmethod
    def from_list(cls, arrays: Sequence[np.ndarray], dtype: Any = None) -> Sequences:
        """From a list of per-sequence arrays [length_i, *features]."""
        if not len(arrays):
            raise SequenceError("Sequences.from_list: expected at least one sequence, found none")
        arrays = [np.asarray(a, dtype=dtype) for a in arrays]
        for i, a in enumerate(arrays):
            if a.ndim < 1 or a.shape[1:] != arrays[0].shape[1:]:
                raise SequenceError(f"Sequences.from_list: sequence {i} has shape {a.shape}; every "
                                    f"sequence must be [length, {', '.join(map(str, arrays[0].shape[1:]))}]")
        starts = np.zeros(len(arrays) + 1, np.int32)
        np.cumsum([len(a) for a in arrays], out=starts[1:])
        return cls(np.ascontiguousarray(np.concatenate(arrays)), starts)

    @classmethod
    def from_padded(cls, padded: np.ndarray, lengths: Any) -> Sequences:
        """From a padded array [num_sequences, max_length, *features] and the true lengths."""
        padded = np.asarray(padded)
        lengths = np.asarray(lengths)
        if lengths.ndim != 1 or len(lengths) != len(padded):
            raise SequenceError(f"Sequences.from_padded: expected one length per sequence "
                                f"({len(padded)}), found shape {lengths.shape}")
        if padded.ndim < 2:
            raise SequenceError(f"Sequences.from_padded: padded must be [sequences, steps, ...], found {padded.shape}")
        if lengths.dtype.kind not in "iu" or (lengths < 0).any():
            raise SequenceError(f"Sequences.from_padded: lengths must be integers of at least 0, found "
                                f"{lengths.tolist()}")
        if (lengths > padded.shape[1]).any():
            i = int(np.argmax(lengths > padded.shape[1]))
            raise SequenceError(f"Sequences.from_padded: sequence {i} has length {lengths[i]} but the "
                                f"padded array holds only {padded.shape[1]} steps")
        return cls.from_list([padded[i, :n] for i, n in enumerate(lengths)])

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.starts)

    @property
    def num_sequences(self) -> int:
        return len(self.starts) - 1

    @property
    def total_steps(self) -> int:
        return int(self.starts[-1])

    def __len__(self):
        return self.num_sequences

    def __getitem__(self, i):
        return self.values[self.starts[i]:self.starts[i + 1]]

    def __repr__(self):
        return (f"Sequences({self.num_sequences} sequences, {self.total_steps} steps, "
                f"features {self.values.shape[1:]}, {self.values.dtype})")

    def to_list(self) -> list[np.ndarray]:
        return [self[i] for i in range(self.num_sequences)]

    def to_padded(self, pad_value: float = 0) -> tuple[np.ndarray, np.ndarray]:
        """(padded [num_sequences, max_length, *features], lengths)."""
        lengths = self.lengths
        out = np.full((self.num_sequences, int(lengths.max())) + self.values.shape[1:], pad_value, self.values.dtype)
        for i, n in enumerate(lengths):
            out[i, :n] = self[i]
        return out, lengths


class BatchOrder:
    """The time-major order of a sequence batch (see the module docstring), computed once per
    batch and shared by every recurrent layer that sees these offsets."""

    def __init__(self, starts):
        starts = np.asarray(starts, dtype=np.int64)
        if len(starts) == 2:  # one sequence (a lone request): a row per step, in its own order
            self._one(int(starts[1] - starts[0]))
        else:
            self._sorted(starts)

    def _sorted(self, starts):
        """Any batch: sequences sorted longest first, each step's rows in that order."""
        lengths = np.diff(starts)
        self.num_sequences = len(lengths)
        self.order = np.argsort(-lengths, kind="stable").astype(np.int32)  # sorted position -> sequence
        sorted_lengths = lengths[self.order]
        self.steps = int(sorted_lengths[0])
        # batch_sizes[t]: how many sequences are longer than t
        self.batch_sizes = np.searchsorted(-sorted_lengths, -np.arange(self.steps), side="left")
        self.step_starts = np.zeros(self.steps + 1, np.int64)
        np.cumsum(self.batch_sizes, out=self.step_starts[1:])
        total = int(self.step_starts[-1])
        t_of = np.repeat(np.arange(self.steps), self.batch_sizes)
        j_of = np.arange(total) - self.step_starts[t_of]
        seq = self.order[j_of]
        # row of the original layout that time-major row i comes from, walking forward or backward
        self.forward_index = (starts[seq] + t_of).astype(np.int32)
        self.reverse_index = (starts[seq] + lengths[seq] - 1 - t_of).astype(np.int32)
        # time-major row of each sorted sequence's final step
        self.last_rows = (self.step_starts[sorted_lengths - 1] + np.arange(self.num_sequences)).astype(np.int32)

    def _one(self, steps):
        """What _sorted gives for a single sequence of `steps` rows, without its ten array
        operations (a sizeable share of a lone request's run)."""
        self.num_sequences, self.steps = 1, steps
        self.order = np.zeros(1, np.int32)
        self.batch_sizes = np.ones(steps, np.int64)
        self.step_starts = np.arange(steps + 1, dtype=np.int64)
        self.forward_index = np.arange(steps, dtype=np.int32)
        self.reverse_index = self.forward_index[::-1].copy()
        self.last_rows = np.array([steps - 1], np.int32)

    def index(self, reverse=False):
        return self.reverse_index if reverse else self.forward_index

    @functools.cached_property
    def previous_rows(self):
        """For each time-major row after the first step's (rows num_sequences and on), the row of
        the same sequence one step earlier (int32)."""
        t_of = np.repeat(np.arange(1, self.steps), self.batch_sizes[1:])
        rows = np.arange(self.num_sequences, int(self.step_starts[-1]))
        return (rows - self.step_starts[t_of] + self.step_starts[t_of - 1]).astype(np.int32)

    def step(self, t):
        """(first row, number of rows) of step t in time-major order."""
        return int(self.step_starts[t]), int(self.batch_sizes[t])
