"""Parameters: a layer's trainable arrays, with their gradient, optimizer state and a version.

The version counts value changes (an optimizer step, a load, `assign`). Caches derived from a
parameter's values, such as MKL packed weights, compare versions and rebuild when it moved, so a
stale cache is impossible as long as values change through this class. That is why `value` is a
read-only view: write with `assign`.
"""
import numpy as np


def host(a):
    """A numpy array of a backend array (numpy arrays as they are; device arrays copied)."""
    return a if isinstance(a, np.ndarray) else a.get()


class Parameter:
    """A trainable array. `buffer` is the kernel-facing storage (a backend array); `grad` its
    gradient (allocated by the scheduler unless frozen); `state` the optimizer's arrays."""

    def __init__(self, value, name=None, lr_mult=1.0, decay_mult=1.0, trainable=True):
        self.buffer = np.ascontiguousarray(value, dtype=np.float32)
        self.name = name
        self.grad = None
        # trainable=False: saved state that is never trained (batch-norm running statistics)
        self.trainable = bool(trainable)
        self._frozen = False
        self.lr_mult = float(lr_mult)
        self.decay_mult = float(decay_mult)
        self.state = {}
        self.backend = None  # the backend that holds buffer; None: not placed yet (a numpy array)
        self.version = 0
        self._grad_pending = False  # see grad_pending
        self._grad_rows = None  # see grad_rows
        self._derived = {}  # key -> ((version, buffer id), an array derived from the values)
        # set by layers that may write only the rows a batch uses (embeddings, selective layers)
        self.row_gradients = False

    def __repr__(self):
        return f"Parameter({self.name!r}, shape={self.shape}, dtype={self.dtype}{', frozen' if self.frozen else ''})"

    @property
    def frozen(self):
        """No gradient and no update (always true of a parameter that is not trainable)."""
        return self._frozen or not self.trainable

    @frozen.setter
    def frozen(self, flag):
        self._frozen = bool(flag)

    @property
    def shape(self):
        return tuple(self.buffer.shape)

    @property
    def dtype(self):
        return self.buffer.dtype

    @property
    def size(self):
        return int(np.prod(self.shape))

    @property
    def value(self):
        """The values as a read-only numpy view (write with `assign`)."""
        v = host(self.buffer).view()
        v.flags.writeable = False
        return v

    def assign(self, values):
        """Copy new values in (same shape); every cache derived from the old values is invalidated."""
        values = np.asarray(values)
        if values.shape != self.shape:
            raise ValueError(f"parameter {self.name!r}: expected values of shape {self.shape}, found {values.shape}")
        if not np.all(np.isfinite(values)):
            raise ValueError(f"parameter {self.name!r}: values contain NaN or infinity")
        if isinstance(self.buffer, np.ndarray):
            np.copyto(self.buffer, values, casting="same_kind")
        else:
            self.buffer.set(np.ascontiguousarray(values, dtype=self.dtype))
        self.changed()

    # -- the gradient's state: only these methods change it
    @property
    def grad_pending(self):
        """Whether grad holds a gradient no optimizer has consumed (the next writer adds to it)."""
        return self._grad_pending

    @property
    def grad_rows(self):
        """The sorted int32 rows a sparse gradient holds (zero elsewhere, whatever the buffer
        holds there), or None for a dense gradient."""
        return self._grad_rows

    def ensure_grad(self, backend):
        """Give the parameter a gradient array on `backend` of its shape and dtype (a new one
        holds no gradient yet)."""
        if self.grad is None or self.grad.shape != self.shape or self.grad.dtype != self.dtype:
            self.grad = backend.empty(self.shape, self.dtype)
            self.drop_grad()

    def grad_target(self, backend):
        """(array, beta) for a writer of the whole gradient: beta 0 for the first writer since
        the last update (overwrite), 1 for every later one (add; a sparse gradient is made
        dense first)."""
        if self._grad_pending:
            self.dense_grad(backend)
        beta = 1.0 if self._grad_pending else 0.0
        self._grad_pending, self._grad_rows = True, None
        return self.grad, beta

    def sparse_grad_target(self, backend, rows):
        """(array, beta) for a writer of `rows` only (sorted, distinct int32): beta 0 means the
        rows are fresh (overwrite them), 1 that they hold gradient already (add; rows new to a
        sparse gradient are zeroed here first). Rows not listed are never written and count
        as zero."""
        if not self._grad_pending:
            self._grad_pending, self._grad_rows = True, rows
            return self.grad, 0.0
        if self._grad_rows is not None:
            backend.fill_rows(self.grad, np.setdiff1d(rows, self._grad_rows, assume_unique=True).astype(np.int32), 0)
            self._grad_rows = np.union1d(self._grad_rows, rows).astype(np.int32)
        return self.grad, 1.0

    def set_sparse_grad(self, backend, rows, values):
        """Make the gradient sparse over `rows` (sorted, distinct int32) with `values` (one row
        each; None: the gradient array holds them already): a gradient summed over processes
        replaces this process's own."""
        if values is not None and len(rows):
            backend.scatter_rows(backend.from_host(values), rows, self.grad)
        self._grad_pending, self._grad_rows = True, rows

    def zero_grad(self, backend):
        """A gradient of zero: no rows, for a parameter whose layer writes rows (a data-parallel
        rank with no samples in a step contributes it)."""
        self.ensure_grad(backend)
        if self.row_gradients:
            self._grad_pending, self._grad_rows = True, np.zeros(0, np.int32)
        else:
            backend.fill(self.grad, 0)
            self._grad_pending, self._grad_rows = True, None

    def drop_grad(self):
        """Forget the gradient (consumed by an update, or refused): the next writer overwrites."""
        self._grad_pending, self._grad_rows = False, None

    def dense_grad(self, backend):
        """The gradient as a full array: a sparse one has its other rows zeroed first; zeros
        when no gradient is pending (the last backward did not reach this parameter, or an
        update consumed it), never what the buffer held before."""
        if not self._grad_pending:
            self.ensure_grad(backend)
            backend.fill(self.grad, 0)
            return self.grad
        if self._grad_rows is not None:
            rows, width = self._grad_rows, self.size // self.shape[0]
            kept = backend.empty((len(rows), width), self.dtype)
            backend.gather_rows(self.grad, rows, kept)
            backend.fill(self.grad, 0)
            backend.scatter_rows(kept, rows, self.grad)
            self._grad_rows = None
        return self.grad

    def derived(self, key, build):
        """build(buffer): an array derived from the values (a copy in another layout), cached
        under `key` and rebuilt once the values or the buffer change. Threads may build the
        same one twice; each gets a complete array."""
        stamp = (self.version, id(self.buffer))
        entry = self._derived.get(key)
        if entry is None or entry[0] != stamp:
            entry = (stamp, build(self.buffer))
            self._derived[key] = entry
        return entry[1]

    def changed(self):
        """Record that the values changed in place (optimizers call this after an update)."""
        self.version += 1

    def move(self, backend):
        """Put the values and optimizer state on `backend` (the gradient is dropped)."""
        self.backend = backend
        self.buffer = self.placed(np.ascontiguousarray(host(self.buffer)))
        self.state = {k: v if v.ndim == 0 else self.placed(host(v)) for k, v in self.state.items()}
        self.grad = None
        self.drop_grad()
        self.changed()

    def placed(self, values):
        """A host array as this parameter's backend holds it: itself where the backend's arrays
        are numpy arrays, else a copy on the device."""
        backend = self.backend
        return values if backend is None or backend.host_arrays else backend.from_host(values)

    def astype(self, dtype):
        """Convert values to dtype; the gradient and optimizer state are dropped."""
        self.buffer = self.placed(np.ascontiguousarray(host(self.buffer), dtype=dtype))
        self.grad = None
        self.state = {}
        self.drop_grad()
        self.changed()
