"""Sums each parameter's gradient over the ranks while backward goes on.

The optimizer hands over a parameter the moment its gradient is complete (the scheduler's update
point). A dense gradient is copied into the open bucket; once the bucket holds `bucket_bytes` it
starts one nonblocking allreduce (MPI_Iallreduce, in place). The gradient of a parameter whose
layer writes only the rows a batch uses (`Parameter.row_gradients`: embeddings, selective layers)
is exchanged on its own: every rank's row count (MPI_Iallgather), then its rows and their values
(MPI_Iallgatherv), then equal rows are summed in rank order, so every rank computes the same
bits. Each parameter's update runs as soon as its own exchange is complete, at the next
hand-over or at the step's end; the step's end waits for the rest.

Every rank must start the same collectives in the same order, so the kind of a parameter's
exchange never depends on this rank's own batch: a layer may write a dense gradient on one rank
(a selective layer's dense path) and rows on another. Row-gradient parameters therefore always
exchange counts first (-1 for a dense gradient); when any rank is dense, all sum the table
densely with one mark per row, which keeps the union of the ranks' rows. When the rows the
ranks gathered reach the table's size, the next step sums that parameter densely with marks
in a bucket. The counts and the marks are the same on every rank, so every rank makes the same
choice.

MPI moves a nonblocking operation forward only inside MPI calls, and the kernels of backward make
none for long stretches, so a progress thread tests the operations in flight every POLL seconds
(the kernels release the GIL) and starts the later stages of row exchanges; the training thread
drives them itself while it waits at the step's end. The training thread starts every operation
on the reducer's communicator in backward order, and each row exchange's later stages run on a
communicator of the parameter's own, so the thread's timing never reorders them.
"""
import threading
import time

import numpy as np


class ReduceStats:
    """Totals since the last reset: seconds some exchange was in flight, seconds the training
    thread waited for exchanges (and for the loss's sum), bytes each rank sent, and the bytes a
    dense allreduce of the same parameters would have sent. Bytes follow the usual algorithms'
    cost: an allreduce of S bytes over N ranks sends 2 S (N-1)/N per rank (ring or
    reduce-scatter + allgather), an allgather sends this rank's block to N-1 ranks."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.steps = 0
        self.in_flight_seconds = 0.0
        self.wait_seconds = 0.0
        self.loss_wait_seconds = 0.0
        self.bytes_sent = 0
        self.dense_bytes = 0  # what allreducing every gradient densely would have sent
        self.sparse_bytes, self.sparse_dense_bytes = 0, 0  # the sparse exchanges, and their dense cost
        self.step_waits = []  # seconds each step's end waited
        self.dense_row_sums = 0  # sparse gradients summed densely (their rows outnumbered the table)

    def hidden_fraction(self):
        """The share of the in-flight time during which training did not wait."""
        if self.in_flight_seconds <= 0:
            return 1.0
        return max(0.0, 1.0 - self.wait_seconds / self.in_flight_seconds)


def merge_rows(rows, values):
    """(sorted distinct rows, the sum of each row's values): equal rows are added in the order
    given (rank order), so every rank gets the same bits."""
    order = np.argsort(rows, kind="stable")
    rows, values = rows[order], values[order]
    first = np.flatnonzero(np.r_[True, rows[1:] != rows[:-1]]) if len(rows) else np.zeros(0, np.intp)
    return rows[first], (np.add.reduceat(values, first, axis=0) if len(rows) else values)


def _packed_size(p):
    """Values of p in a dense sum: its gradient, and one mark per row if its layer writes rows."""
    return p.size + (p.shape[0] if p.row_gradients else 0)


class _Exchange:
    """One operation in flight: a generator that yields lists of MPI requests and finally
    returns the function that writes its result into the gradients."""

    __slots__ = ("stages", "requests", "write", "params", "what")

    def __init__(self, stages, params, what):
        self.stages, self.params, self.what = stages, params, what
        self.requests = next(stages)  # the first stage starts here, on the training thread
        self.write = None


class GradientReducer:
    """Installed as `optimizer.reducer` by lamina.distributed.data_parallel (see the module
    docstring)."""

    POLL = 100e-6  # seconds between the progress thread's tests
    # exchanges in flight for longer than PATIENCE seconds wait on a rank that is late (or has
    # stopped): both threads then test them every LATE_POLL seconds, where the training thread
    # polled without pause and would hold a whole core until the timeout
    PATIENCE = 0.05
    LATE_POLL = 2e-3

    def __init__(self, world, optimizer, bucket_bytes, overlap=True):
        self.world, self.optimizer = world, optimizer
        self.overlap = overlap  # False: every exchange starts at the step's end (for comparison)
        self._held, self._dense_order, self._last_dense = [], [], None
        self.MPI = world.MPI
        self.bucket_bytes = max(1, int(bucket_bytes))
        self.comm = world.comm.Dup()  # gradients travel apart from the world's other traffic
        self._row_comms = {}  # id(param) -> the communicator of its sparse exchanges' second stage
        self._rows_dense = {}  # id(param) -> whether its row gradient is summed densely this step
        self._buffers = {}  # bucket (parameter ids) -> its flat buffer, reused every step
        self._cv = threading.Condition()  # guards the lists of exchanges
        self._advancing = threading.Lock()  # held by the thread that tests and advances them
        self._testall = world.MPI.Request.Testall
        self._active, self._done = [], []
        self._failure = None  # an exception raised on the progress thread
        self._busy_since = None
        self._thread = None
        self._open, self._open_bytes = [], 0
        self.stats = ReduceStats()
        share = (world.size - 1) / world.size
        self._allreduce_share, self._allgather_share = 2 * share, world.size - 1

    # ------------------------------------------------------------------ the training thread
    def begin(self):
        self._open, self._open_bytes = [], 0
        self._held = []  # parameters whose exchange waits for the step's end (overlap off)
        self._dense_order = []  # this step's dense parameters, in the order they complete
        self.stats.steps += 1

    def sum(self, values):
        """The elementwise sum over the ranks of a small float64 vector (the costs' sums and row
        counts), waited for now."""
        start = time.perf_counter()
        out = self.world.sum(values, "the other ranks' losses")
        self.stats.loss_wait_seconds += time.perf_counter() - start
        return out

    def submit(self, p):
        """p's gradient is complete here: start (or queue) its exchange; run the updates whose
        exchanges have finished."""
        if not self.overlap:
            self._held.append(p)
            return
        self._exchange(p)
        self._apply_finished()

    def _exchange(self, p):
        if p.row_gradients and not self._rows_dense.get(id(p)):
            self._start(self._rows_stages(p), [p], f"the rows of '{p.name}'")
            return
        # a dense gradient; or one of a layer that writes rows, whose ranks' rows outnumbered
        # its table last step: summed densely, with a mark per row (see _pack)
        if p.row_gradients:
            self.stats.dense_row_sums += 1
        if self._open and self._open[0].dtype != p.dtype:
            self._close_bucket()
        self._open.append(p)
        self._open_bytes += _packed_size(p) * p.dtype.itemsize
        self._dense_order.append(id(p))
        # a bucket starts once full, or with the last dense gradient of the previous step (no
        # more will come: waiting for the step's end would only delay it)
        if self._open_bytes >= self.bucket_bytes or id(p) == self._last_dense:
            self._close_bucket()

    def finish(self):
        """At the step's end: start the last bucket, wait for every exchange, run the updates.
        The training thread drives MPI itself while it waits (a poll moves a transfer by one
        shared-memory cell or network packet, so polling at the thread's pace would stretch it)."""
        start = time.perf_counter()
        for p in self._held:
            self._exchange(p)
        self._close_bucket()
        self._last_dense = self._dense_order[-1] if self._dense_order else None
        deadline = time.monotonic() + self.world.timeout
        while self._advance():
            if time.monotonic() > deadline:
                self.world.abort(f"waited {self.world.timeout:g} s for {self._active[0].what} "
                                 f"to be summed: another rank stopped or hangs")
            if self._late():
                time.sleep(self.LATE_POLL)
        waited = time.perf_counter() - start
        self.stats.wait_seconds += waited
        self.stats.step_waits.append(waited)
        self._apply_finished()

    def _close_bucket(self):
        if self._open:
            params = self._open
            self._open, self._open_bytes = [], 0
            what = f"the gradients of {', '.join(repr(p.name) for p in params)}"
            self._start(self._dense_stages(params), params, what)

    def _start(self, stages, params, what):
        if self._thread is None:
            self._thread = threading.Thread(target=self._progress, name="lamina-gradients", daemon=True)
            self._thread.start()
        op = _Exchange(stages, params, what)
        with self._cv:
            if not self._active:
                self._busy_since = time.perf_counter()
            self._active.append(op)
            self._cv.notify_all()

    def _apply_finished(self):
        with self._cv:
            if self._failure is not None:
                raise RuntimeError(f"summing gradients over the ranks failed: {self._failure}") from self._failure
            done, self._done = self._done, []
        for op in done:
            op.write()
            for p in op.params:
                self.optimizer.update_summed(p)

    def _be(self, p):
        return self.optimizer._be(p)

    # ------------------------------------------------------------------ the exchanges
    def _buffer(self, key, size, dtype):
        flat = self._buffers.get(key)
        if flat is None or flat.size != size or flat.dtype != dtype:
            flat = self._buffers[key] = np.empty(size, dtype)
        return flat

    def _pack(self, p, out):
        """p's gradient, dense, into out[:p.size] (a sparse one's other rows are zeroed); for a
        parameter whose layer writes rows, one mark per table row after it: 1 where this rank's
        gradient has the row (every row, for a dense one), so the sum keeps the union of the
        ranks' rows (what lazy optimizers update)."""
        be, rows = self._be(p), p.grad_rows
        if rows is not None:
            p.dense_grad(be)
        out[:p.size] = be.to_host(p.grad).reshape(-1)
        if p.row_gradients:
            marks = out[p.size:]
            marks[:] = 1 if rows is None else 0
            if rows is not None:
                marks[rows] = 1

    def _unpack(self, p, summed):
        """Write a summed segment back: the gradient, and a parameter with marks keeps the rows
        any rank had (all of them: a dense gradient). Returns how many rows the ranks had in all
        (a rank with a dense gradient counts the table)."""
        be = self._be(p)
        be.copy(be.from_host(summed[:p.size].reshape(p.shape)), p.grad)
        if not p.row_gradients:
            return None
        marks = summed[p.size:]
        rows = np.flatnonzero(marks).astype(np.int32)
        if len(rows) < p.shape[0]:
            p.set_sparse_grad(be, rows, None)
        return float(marks.sum())

    def _count_sent(self, p, nbytes, gathered):
        """Count the bytes of one exchange of p (allreduce, or this rank's allgather block)."""
        sent = int(nbytes * (self._allgather_share if gathered else self._allreduce_share))
        dense = int(p.size * p.dtype.itemsize * self._allreduce_share)
        self.stats.bytes_sent += sent
        self.stats.dense_bytes += sent if not p.row_gradients else dense
        if p.row_gradients:
            self.stats.sparse_bytes += sent
            self.stats.sparse_dense_bytes += dense

    def _dense_stages(self, params):
        """One allreduce of a bucket of dense gradients (each with its row marks, see _pack)."""
        sizes = [_packed_size(p) for p in params]
        flat = self._buffer(tuple(id(p) for p in params), sum(sizes), params[0].dtype)
        offsets = np.cumsum([0] + sizes)
        for p, o, n in zip(params, offsets, sizes):
            self._pack(p, flat[o:o + n])
            self._count_sent(p, n * p.dtype.itemsize, gathered=False)
        yield [self.comm.Iallreduce(self.MPI.IN_PLACE, flat, op=self.MPI.SUM)]

        def write():
            for p, o, n in zip(params, offsets, sizes):
                total = self._unpack(p, flat[o:o + n])
                if total is not None:  # the same sum on every rank, so the same choice
                    self._rows_dense[id(p)] = total >= p.shape[0]
        return write

    def _rows_stages(self, p):
        """The rows of p's gradient from every rank: their counts (-1: this rank's gradient is
        dense), then the rows and values (an allgather) summed row by row; or, when a rank's
        gradient is dense, the dense sum with row marks."""
        comm = self._row_comms.get(id(p))
        if comm is None:
            comm = self._row_comms[id(p)] = self.comm.Dup()
        be = self._be(p)
        rows = p.grad_rows
        width = p.size // p.shape[0]
        if rows is not None:
            rows = np.ascontiguousarray(rows, np.int32)
            picked = be.empty((len(rows),) + p.shape[1:], p.dtype)
            be.gather_rows(p.grad, rows, picked)
            values = np.ascontiguousarray(be.to_host(picked)).reshape(len(rows), width)
        counts = np.empty(self.world.size, np.int64)
        yield [comm.Iallgather(np.array([-1 if rows is None else len(rows)], np.int64), counts)]
        counts = [int(c) for c in counts]
        # the next step sums this gradient densely if the ranks' rows reach the table's (the
        # same counts, so the same choice, on every rank)
        self._rows_dense[id(p)] = sum(p.shape[0] if c < 0 else c for c in counts) >= p.shape[0]
        if min(counts) < 0:
            flat = self._buffer(("marked", id(p)), _packed_size(p), p.dtype)
            self._pack(p, flat)
            self._count_sent(p, flat.nbytes, gathered=False)
            yield [comm.Iallreduce(self.MPI.IN_PLACE, flat, op=self.MPI.SUM)]
            return lambda: self._unpack(p, flat)
        self._count_sent(p, rows.nbytes + values.nbytes, gathered=True)
        all_rows = np.empty(sum(counts), np.int32)
        all_values = np.empty((sum(counts), width), p.dtype)
        yield [comm.Iallgatherv(rows, [all_rows, counts]),
               comm.Iallgatherv(values, [all_values, [c * width for c in counts]])]
        merged, summed = merge_rows(all_rows, all_values)

        def write():
            p.set_sparse_grad(be, merged.astype(np.int32), summed.reshape((len(merged),) + p.shape[1:]))
        return write

    # ------------------------------------------------------------------ progress
    def _advance(self):
        """Test the exchanges in flight once and start the next stage of those whose stage is
        complete; returns whether any is still in flight. Either thread may call it: one at a
        time advances."""
        with self._advancing:
            with self._cv:
                ops = list(self._active)
            if not ops:
                return False
            finished = []
            try:
                for op in ops:
                    if self._testall(op.requests):
                        try:
                            op.requests = op.stages.send(None)
                        except StopIteration as end:
                            op.write = end.value
                            finished.append(op)
            except Exception as e:  # raised on the training thread by _apply_finished
                with self._cv:
                    self._failure = e
                    self._active = []
                return False
            with self._cv:
                for op in finished:
                    self._active.remove(op)
                self._done += finished
                if finished and not self._active:
                    self.stats.in_flight_seconds += time.perf_counter() - self._busy_since
                return bool(self._active)

    def _progress(self):
        """The progress thread: while exchanges are in flight, advance them every POLL seconds."""
        while True:
            with self._cv:
                while not self._active:
                    self._cv.wait()
            self._advance()
            time.sleep(self.LATE_POLL if self._late() else self.POLL)

    def _late(self):
        """Whether the exchanges have been in flight past PATIENCE (a rank is late)."""
        busy_since = self._busy_since
        return bool(self._active) and busy_since is not None and \
            time.perf_counter() - busy_since > self.PATIENCE
