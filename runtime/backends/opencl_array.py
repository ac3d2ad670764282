"""The OpenCL backend's arrays: pyopencl arrays whose row slices and reshapes are cheap.

pyopencl builds every view through its general constructor, which validates the shape through
numpy, tens of microseconds of host Python per view on every device. A recurrent layer slices
its buffers for every time step, so on a GPU a step's host time was many times its kernels'. Here a slice of the first axis with step 1,
and a reshape of a C-contiguous array (to a shape of the same size, one dimension may be -1),
build the view directly (pyopencl's own fast constructor, no checks left to do); every other
index or reshape takes pyopencl's path. Indexed by opencl_plan.StepRows, an array gives the
rows of many steps at once (opencl_plan.StepBlock), as a recorded plan takes them.
"""
import math

import pyopencl.array as cla

from .opencl_plan import NotRecordable, PerStep, StepBlock, StepRows


def _c_strides(shape, itemsize):
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


class DeviceArray(cla.Array):
    def _view(self, shape, strides, offset, size):
        return type(self)(None, shape, self.dtype, allocator=self.allocator, data=self.base_data, offset=offset,
                          strides=strides, events=self.events, _fast=True, _size=size, _context=self.context,
                          _queue=self.queue)

    def __getitem__(self, index):
        if type(index) is StepRows:  # the rows of many steps at once, for a recorded plan
            return StepBlock(self, index)
        if type(index) is slice and (isinstance(index.start, PerStep) or isinstance(index.stop, PerStep)):
            raise NotRecordable("a slice of a size per step")
        if type(index) is slice and index.step in (None, 1) and self.shape:
            start, stop, _ = index.indices(self.shape[0])
            rows = max(stop - start, 0)
            shape = (rows,) + self.shape[1:]
            size = self.size // self.shape[0] * rows if self.shape[0] else 0
            # (as in numpy, an empty view starts where its array does)
            offset = self.offset + start * self.strides[0] if rows else self.offset
            return self._view(shape, self.strides, offset, size)
        return super().__getitem__(index)

    def reshape(self, *shape, **kwargs):
        if not kwargs and shape:
            dims = tuple(shape[0]) if isinstance(shape[0], (tuple, list)) else shape
            if all(type(n) is int for n in dims) and self.strides == _c_strides(self.shape, self.dtype.itemsize):
                known = math.prod(n for n in dims if n != -1)
                if dims.count(-1) == 1 and known > 0 and self.size % known == 0:
                    dims = tuple(self.size // known if n == -1 else n for n in dims)
                if all(n >= 0 for n in dims) and known > 0 and math.prod(dims) == self.size:
                    return self._view(dims, _c_strides(dims, self.dtype.itemsize), self.offset, self.size)
        return super().reshape(*shape, **kwargs)


def empty(queue, shape, dtype, allocator):
    return DeviceArray(queue, shape, dtype, allocator=allocator)


def to_device(queue, host, allocator, wait=True):
    """A device copy of a C-contiguous numpy array; wait=False returns once the copy is enqueued
    (the copy's event, kept with the array, holds the host array until it has run)."""
    out = DeviceArray(queue, host.shape, host.dtype, allocator=allocator)
    out.set(host, queue=queue, async_=not wait)
    return out
