"""Sums each parameter's gradient over the ranks while backward goes on.

The optimizer hands over a parameter the moment its gradient is complete (the scheduler's update
point). A dense gradient is copied into the open bucket; once the bucket holds `bucket_bytes` it
starts one nonblocking allreduce (MPI_Iallreduce, in place). A sparse gradient (rows of an
embedding or selective layer) is exchanged on its own: every rank's row count (MPI_Iallgather),
then its rows and their values (MPI_Iallgatherv), then equal rows are summed in rank order, so
every rank computes the same bits. Each parameter's update runs as soon as its own exchange is
complete, at the next hand-over or at the step's end; the step's end waits for the rest.

MPI moves a nonblocking operation forward only inside MPI calls, and the kernels of backward make
none for long stretches, so a progress thread tests the operations in flight every POLL seconds
(the kernels release the GIL) and starts the second stage of sparse exchanges. Collectives on one
communicator must start in the same order on every rank; the main thread starts every operation
on the reducer's communicator in backward order, and each sparse parameter's second stage runs on
a communicator of its own, so the thread's timing never reorders them.
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

    def __init__(self, world, optimizer, bucket_bytes, overlap=True):
        self.world, self.optimizer = world, optimizer
        self.overlap = overlap  # False: every exchange starts at the step's end (for comparison)
        self._held, self._dense_order, self._last_dense = [], [], None
        self.MPI = world.MPI
        self.bucket_bytes = max(1, int(bucket_bytes))
        self.comm = world.comm.Dup()  # gradients travel apart from the world's other traffic
        self._row_comms = {}  # id(param) -> the communicator of its sparse exchanges' second stage
        self._rows_dense = {}  # id(param) -> whether its sparse gradient is summed densely this step
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
        rows = p.grad_rows
        if rows is not None and not self._rows_dense.get(id(p)):
            self._start(self._rows_stages(p), [p], f"the rows of '{p.name}'")
            return
        if rows is not None:  # too many rows to gather: summed densely, with a mark per row touched
            p.dense_grad(self._be(p))
            self.stats.dense_row_sums += 1
        if self._open and self._open[0][0].dtype != p.dtype:
            self._close_bucket()
        self._open.append((p, rows))
        self._open_bytes += (p.size + (0 if rows is None else p.shape[0])) * p.dtype.itemsize
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
        waited = time.perf_counter() - start
        self.stats.wait_seconds += waited
        self.stats.step_waits.append(waited)
        self._apply_finished()

    def _close_bucket(self):
        if self._open:
            entries = self._open
            self._open, self._open_bytes = [], 0
            what = f"the gradients of {', '.join(repr(p.name) for p, _ in entries)}"
            self._start(self._dense_stages(entries), [p for p, _ in entries], what)

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
    def _dense_stages(self, entries):
        """One allreduce of a bucket: (parameter, rows) entries, rows None for a dense gradient,
        else the rows of a sparse gradient summed densely; each such entry carries one mark per
        table row (1 where this rank's gradient has the row), so the sum keeps the union of the
        ranks' rows (lazy optimizers update exactly those)."""
        sizes = [p.size + (0 if rows is None else p.shape[0]) for p, rows in entries]
        key = tuple((id(p), rows is None) for p, rows in entries)
        flat = self._buffers.get(key)
        if flat is None:
            flat = self._buffers[key] = np.empty(sum(sizes), entries[0][0].dtype)
        offsets = np.cumsum([0] + sizes)
        for (p, rows), o in zip(entries, offsets):
            flat[o:o + p.size] = self._be(p).to_host(p.grad).reshape(-1)
            if rows is not None:
                marks = flat[o + p.size:o + p.size + p.shape[0]]
                marks[:] = 0
                marks[rows] = 1
            sent = int((p.size + (0 if rows is None else p.shape[0])) * p.dtype.itemsize * self._allreduce_share)
            self.stats.bytes_sent += sent
            self.stats.dense_bytes += sent if rows is None else int(p.size * p.dtype.itemsize * self._allreduce_share)
            if rows is not None:
                self.stats.sparse_bytes += sent
                self.stats.sparse_dense_bytes += int(p.size * p.dtype.itemsize * self._allreduce_share)
        yield [self.comm.Iallreduce(self.MPI.IN_PLACE, flat, op=self.MPI.SUM)]
        marked = {}
        for (p, rows), o in zip(entries, offsets):
            if rows is not None:
                marks = flat[o + p.size:o + p.size + p.shape[0]]
                marked[id(p)] = np.flatnonzero(marks).astype(np.int32)
                self._rows_dense[id(p)] = marks.sum() > p.shape[0]  # the same sum on every rank

        def write():
            for (p, rows), o in zip(entries, offsets):
                be = self._be(p)
                be.copy(be.from_host(flat[o:o + p.size].reshape(p.shape)), p.grad)
                if rows is not None:
                    p.set_sparse_grad(be, marked[id(p)], None)
        return write

    def _rows_stages(self, p):
        comm = self._row_comms.get(id(p))
        if comm is None:
            comm = self._row_comms[id(p)] = self.comm.Dup()
        be = self._be(p)
        rows = np.ascontiguousarray(p.grad_rows, np.int32)
        width = p.size // p.shape[0]
        picked = be.empty((len(rows),) + p.shape[1:], p.dtype)
        be.gather_rows(p.grad, rows, picked)
        values = np.ascontiguousarray(be.to_host(picked)).reshape(len(rows), width)
        self.stats.bytes_sent += (rows.nbytes + values.nbytes) * self._allgather_share
        self.stats.sparse_bytes += (rows.nbytes + values.nbytes) * self._allgather_share
        dense = int(p.size * p.dtype.itemsize * self._allreduce_share)
        self.stats.dense_bytes += dense
        self.stats.sparse_dense_bytes += dense
        counts = np.empty(self.world.size, np.int64)
        yield [comm.Iallgather(np.array([len(rows)], np.int64), counts)]
        counts = [int(c) for c in counts]
        # the next step sums this gradient densely if the ranks' rows outnumber the table's (the
        # same counts, so the same choice, on every rank)
        self._rows_dense[id(p)] = sum(counts) > p.shape[0]
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
            time.sleep(self.POLL)
