"""Sequence batches: construction, conversion, validation, and the time-major batch order."""
import numpy as np
import pytest

from lamina.sequence import BatchOrder, SequenceError, Sequences


def three():
    rng = np.random.default_rng(0)
    return [rng.standard_normal((n, 2)).astype(np.float32) for n in (2, 4, 2)]


def test_from_list_and_back():
    arrays = three()
    s = Sequences.from_list(arrays)
    assert s.starts.tolist() == [0, 2, 6, 8] and s.values.shape == (8, 2) and len(s) == 3
    for a, b in zip(arrays, s.to_list()):
        np.testing.assert_array_equal(a, b)


def test_from_padded_and_back():
    arrays = three()
    padded, lengths = Sequences.from_list(arrays).to_padded(pad_value=-1)
    assert padded.shape == (3, 4, 2) and lengths.tolist() == [2, 4, 2]
    assert (padded[0, 2:] == -1).all()
    s = Sequences.from_padded(padded, lengths)
    np.testing.assert_array_equal(s.values, np.concatenate(arrays))


@pytest.mark.parametrize("starts,message", [
    ([1, 3, 8], "must begin at 0, found 1"),
    ([0, 5, 3, 8], r"must not decrease, found starts\[1\]=5 > starts\[2\]=3"),
    ([0, 3, 7], "must end at the number of rows, 8, found 7"),
    ([0, 3, 3, 8], "sequence 1 is empty"),
    ([0], "at least 2"),
])
def test_bad_offsets(starts, message):
    with pytest.raises(SequenceError, match=message):
        Sequences(np.zeros((8, 2), np.float32), np.array(starts, np.int32))


def test_bad_offset_dtype_and_shapes():
    with pytest.raises(SequenceError, match="starts must be int32, found int64"):
        Sequences(np.zeros((8, 2)), np.array([0, 8]))
    with pytest.raises(SequenceError, match=r"sequence 1 has shape \(3, 5\)"):
        Sequences.from_list([np.zeros((2, 4)), np.zeros((3, 5))])
    with pytest.raises(SequenceError, match="sequence 0 has length 5 but the padded array holds only 4"):
        Sequences.from_padded(np.zeros((2, 4, 3)), [5, 1])


def test_batch_order_sorts_longest_first_with_stable_ties():
    # lengths 2, 4, 2, 1, 4: sorted 1(4), 4(4), 0(2), 2(2), 3(1)
    starts = np.array([0, 2, 6, 8, 9, 13], np.int32)
    o = BatchOrder(starts)
    assert o.order.tolist() == [1, 4, 0, 2, 3]
    assert o.steps == 4 and o.batch_sizes.tolist() == [5, 4, 2, 2]
    assert o.step_starts.tolist() == [0, 5, 9, 11, 13]
    # step 0: first rows in sorted order; step 1: the second rows of every sequence longer than 1
    assert o.forward_index[:5].tolist() == [2, 9, 0, 6, 8]
    assert o.forward_index[5:9].tolist() == [3, 10, 1, 7]
    assert o.forward_index[9:].tolist() == [4, 11, 5, 12]
    # reversed: each sequence walked from its end
    assert o.reverse_index[:5].tolist() == [5, 12, 1, 7, 8]
    assert o.reverse_index[9:].tolist() == [3, 10, 2, 9]
    # last steps: sequence 1 ends at step 3 (row 11), 4 at 12, 0 and 2 at step 1 (rows 7, 8), 3 at step 0 (row 4)
    assert o.last_rows.tolist() == [11, 12, 7, 8, 4]
    assert sorted(o.forward_index.tolist()) == list(range(13))


@pytest.mark.parametrize("steps", [1, 2, 37])
def test_batch_order_of_one_sequence_equals_the_sorted_form(steps):
    """A lone sequence takes a shortcut; every field equals the general computation's, dtypes too."""
    starts = np.array([0, steps], np.int32)
    fast = BatchOrder(starts)
    general = BatchOrder.__new__(BatchOrder)
    general._sorted(np.asarray(starts, np.int64))
    assert vars(fast).keys() == vars(general).keys()
    for name, value in vars(general).items():
        got = getattr(fast, name)
        if isinstance(value, np.ndarray):
            assert got.dtype == value.dtype and got.tolist() == value.tolist(), name
        else:
            assert got == value, name


def test_gather_and_scatter_rows(backend):
    starts = np.array([0, 2, 6, 8, 9, 13], np.int32)
    o = BatchOrder(starts)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((13, 3))
    tm = np.full_like(x, np.nan)
    backend.gather_rows(x, o.index(), tm)
    np.testing.assert_array_equal(tm, x[o.forward_index])
    back = rng.standard_normal((13, 3))
    expected = back.copy()
    expected[o.reverse_index] += tm
    backend.scatter_rows(tm, o.index(reverse=True), back, beta=1.0)
    np.testing.assert_allclose(back, expected, rtol=1e-15)
    fresh = np.full_like(x, np.nan)
    backend.scatter_rows(tm, o.index(), fresh, beta=0.0)
    np.testing.assert_array_equal(fresh, x)


@pytest.mark.parametrize("lengths", [[5], [3, 1, 5, 2], [2, 2, 2], [1, 1], [4, 6, 6, 1, 3]])
def test_previous_rows_are_each_sequences_step_before(lengths):
    """BatchOrder.previous_rows: for each row after the first step, the row that holds the same
    sequence one step earlier (what a recurrent weight gradient reads as h_{t-1})."""
    o = BatchOrder(np.concatenate([[0], np.cumsum(lengths)]))
    seq_of_row = {}
    for t in range(o.steps):
        r0, b = o.step(t)
        for j in range(b):
            seq_of_row[r0 + j] = (o.order[j], t)
    rows = range(o.num_sequences, int(o.step_starts[-1]))
    assert o.previous_rows.dtype == np.int32 and len(o.previous_rows) == len(rows)
    for r, p in zip(rows, o.previous_rows):
        seq, t = seq_of_row[r]
        assert seq_of_row[int(p)] == (seq, t - 1)
