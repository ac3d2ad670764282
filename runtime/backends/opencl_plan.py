"""Recorded launch plans: how the OpenCL backend runs the time steps of a recurrence without
Python between them.

The layer's own step code (lamina.backends.stepwise, the cells of lamina.layers.recurrent) is
called once for all steps but the first, with `StepBlock`s where it would have row slices: the
rows of every step at once, whose row count and offset are a value per step (`PerStep`). The
backend's kernel wrappers build their launches from those as they do from arrays, so each launch
comes out with the arguments that change between steps as vectors; while a plan records, the
backend keeps the launches instead of enqueueing them (OpenCLBackend._run). `Plan.enqueue` then
sets each launch's constant arguments once and hands the rest to compiled code
(`_opencl_steps.enqueue`), which walks the steps, sets the changing int32 arguments and enqueues
each launch: a step costs the driver's enqueues.

A call that cannot be recorded (one that reads a result back to the host, fills or copies by
other means than a kernel of the backend's programs) raises NotRecordable while recording; the
backend then runs those steps one by one as before. Nothing recorded has been enqueued by then.
"""
import contextlib
import ctypes
import ctypes.util
import functools

import numpy as np

from ..errors import OpenCLError


class NotRecordable(Exception):
    """Raised while a plan records by a call that cannot run in one (see the module docstring)."""


class PerStep(np.ndarray):
    """One value per step (a row count, an offset). It compares as a whole: `a == b` holds where it
    holds at every step, so the backend's checks written for one block check every step's."""

    def __eq__(self, other):
        return bool(np.all(np.asarray(self) == np.asarray(other)))

    def __ne__(self, other):
        return not self.__eq__(other)

    __hash__ = None


def per_step(values):
    return np.asarray(values, dtype=np.int64).view(PerStep)


class StepRows:
    """The rows [starts[s], starts[s] + counts[s]) of each step s: indexing a device array by it
    gives a StepBlock."""

    def __init__(self, starts, counts):
        self.starts, self.counts = per_step(starts), per_step(counts)
        if self.starts.shape != self.counts.shape or self.starts.ndim != 1:
            raise ValueError(f"StepRows: starts {self.starts.shape} and counts {self.counts.shape} must be one "
                             f"vector each, of the same length")
        starts, counts = np.asarray(self.starts), np.asarray(self.counts)
        # the first row any step takes (-1 where a count is negative) and the row past the last:
        # bounds checked once per array indexed
        self.low = (int(starts.min()) if counts.min() >= 0 else -1) if starts.size else 0
        self.high = int((starts + counts).max()) if starts.size else 0


def step_rows(order, steps):
    """(the rows of each of these steps of a BatchOrder, the rows of their previous states in the
    step before) as StepRows; none of the steps may be the first."""
    t = np.asarray(steps, dtype=np.int64)
    if t.size and t.min() < 1:
        raise ValueError(f"step_rows: steps must follow a first step, found step {t.min()}")
    counts = order.batch_sizes[t]
    return StepRows(order.step_starts[t], counts), StepRows(order.step_starts[t - 1], counts)


class StepBlock:
    """The rows of a 2-D device array given by StepRows, one block per step, with what the
    backend's kernel wrappers read of an array: shape (row counts, width), size, dtype, strides,
    ndim, base_data and offset (in bytes, per step)."""

    def __init__(self, array, rows):
        if array.ndim != 2:
            raise NotRecordable(f"rows of a {array.ndim}-D array")
        if rows.low < 0 or rows.high > array.shape[0]:
            starts, counts = np.asarray(rows.starts), np.asarray(rows.counts)
            bad = int(np.flatnonzero((starts < 0) | (counts < 0) | (starts + counts > array.shape[0]))[0])
            raise IndexError(f"step rows: step {bad} takes rows {starts[bad]}..{starts[bad] + counts[bad]} of an "
                             f"array of {array.shape[0]} rows")
        self.array, self.rows = array, rows
        self.dtype, self.strides, self.ndim = array.dtype, array.strides, 2
        self.base_data = array.base_data
        self.shape = (rows.counts, array.shape[1])
        self.size = rows.counts * array.shape[1]
        self.offset = (array.offset + rows.starts * array.strides[0]).view(PerStep)

    def reshape(self, *shape):
        raise NotRecordable("reshaping step rows")

    def __getitem__(self, index):
        raise NotRecordable("indexing step rows")


@functools.cache
def entry_points():
    """(clSetKernelArg, clEnqueueNDRangeKernel) addresses of the OpenCL library pyopencl loaded, or
    None where it cannot be found (then recurrences run step by step)."""
    import pyopencl._cl  # noqa: F401  (loads the library)
    paths = []
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split(None, 5)[5].strip() for line in maps
                     if "libOpenCL" in line and len(line.split(None, 5)) == 6]
    except OSError:
        pass
    for path in paths + [ctypes.util.find_library("OpenCL")]:
        if not path:
            continue
        try:
            lib = ctypes.CDLL(path)
            return tuple(ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                         for name in ("clSetKernelArg", "clEnqueueNDRangeKernel"))
        except (OSError, AttributeError):
            continue
    return None


class Launch:
    """One recorded kernel launch: its program's key, the kernel's name, global and local sizes
    and arguments, any of them per step."""

    def __init__(self, program, name, global_size, local, args):
        self.program, self.name, self.global_size, self.local, self.args = program, name, global_size, local, args


class Plan:
    """The launches of `steps` steps, recorded once (see the module docstring)."""

    def __init__(self, steps):
        self.steps = steps
        self.launches = []
        self._last_only = False

    @contextlib.contextmanager
    def at_last_step(self):
        """Launches recorded inside run once, after the last step's (their global size is 0 in
        every other step): what follows the steps, enqueued with them."""
        self._last_only = True
        try:
            yield
        finally:
            self._last_only = False

    def add(self, program, name, global_size, local, args):
        for v in list(global_size) + list(args):
            if isinstance(v, np.ndarray) and v.shape != (self.steps,):
                raise ValueError(f"plan: a per-step value of shape {v.shape} in {name} for {self.steps} steps")
        if self._last_only:
            last = np.arange(self.steps) == self.steps - 1
            global_size = [np.where(last, g, 0).view(PerStep) for g in global_size]
        self.launches.append(Launch(program, name, tuple(global_size), local, list(args)))

    def enqueue(self, backend):
        """Sets every launch's constant arguments once, on a kernel object of its own, and
        enqueues all steps, both by compiled code. Call with the backend's lock held."""
        from . import _opencl_steps
        S, K = self.steps, len(self.launches)
        if S == 0 or K == 0:
            return
        kernels = np.array([backend._plan_kernel(launch.program, launch.name, k).int_ptr
                            for k, launch in enumerate(self.launches)], np.uint64)
        varying = [[i for i, a in enumerate(launch.args) if isinstance(a, np.ndarray)] for launch in self.launches]
        P = max(1, max(len(v) for v in varying))
        C = max(1, max(len(launch.args) - len(v) for launch, v in zip(self.launches, varying)))
        patch_args, patch_values = np.full((K, P), -1, np.int32), np.zeros((S, K, P), np.int64)
        const_args, const_sizes = np.full((K, C), -1, np.int32), np.zeros((K, C), np.int64)
        const_values = np.zeros((K, C), np.uint64)
        dims, local = np.zeros(K, np.int32), np.zeros((K, 3), np.int64)
        global_size = np.ones((S, K, 3), np.int64)
        for k, launch in enumerate(self.launches):
            c = 0
            for i, a in enumerate(launch.args):
                if isinstance(a, np.ndarray):
                    continue
                const_args[k, c] = i
                const_sizes[k, c], const_values[k, c] = _constant(a, launch.name, i)
                c += 1
            for p, i in enumerate(varying[k]):
                patch_args[k, p] = i
                patch_values[:, k, p] = launch.args[i]
            dims[k] = len(launch.global_size)
            for d, g in enumerate(launch.global_size):
                global_size[:, k, d] = g
            if launch.local is not None:
                local[k, :len(launch.local)] = launch.local
                local[k, len(launch.local):] = 1
        if patch_values.size and (patch_values.min() < -2 ** 31 or patch_values.max() >= 2 ** 31):
            raise OpenCLError(f"plan: an argument that changes from step to step must fit int32, found values in "
                              f"[{patch_values.min()}, {patch_values.max()}]")
        set_arg, enqueue = entry_points()
        err, at, arg = _opencl_steps.set_constants(set_arg, kernels, const_args, const_sizes, const_values)
        if err != 0:
            raise OpenCLError(f"setting argument {arg} of {self.launches[at].name} in a recorded plan failed with "
                              f"OpenCL error {err}")
        err, step, at = _opencl_steps.enqueue(set_arg, enqueue, backend.queue.int_ptr, kernels, dims, local,
                                              global_size, patch_args, patch_values.astype(np.int32))
        if err != 0:
            raise OpenCLError(f"enqueueing {self.launches[at].name} at step {step} of a recorded plan of {S} "
                              f"steps failed with OpenCL error {err}")


_BITS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}  # a scalar's bytes as an unsigned integer


def _constant(a, kernel, index):
    """(size in bytes, value as 8 bytes) of a constant kernel argument, as set_constants takes
    it: a memory object by its handle (None: no object), local memory by minus its size, a numpy
    scalar by its bytes."""
    if a is None:
        return 8, 0
    if isinstance(a, np.generic) and a.dtype.itemsize in _BITS:
        return a.dtype.itemsize, int(a.view(_BITS[a.dtype.itemsize]))
    if type(a).__name__ == "LocalMemory":
        return -int(a.size), 0
    if hasattr(a, "int_ptr"):  # a buffer (pooled or not)
        return 8, int(a.int_ptr)
    raise OpenCLError(f"plan: argument {index} of {kernel} is a {type(a).__name__}, which a recorded plan cannot pass")
