"""The OpenCL backend: pyopencl arrays from a memory pool, kernels from the OpenCL C sources (the
package lamina.opencl: opencl/*.cl in the repository) built once per context and element type.

Device choice: `OpenCLBackend(device)` with device an index ('opencl:N' counts every device of
every platform, in `lamina devices` order), else PYOPENCL_CTX, else the first GPU, else the first
device. One context, one in-order queue and one `pyopencl.tools.MemoryPool` per backend object.
Programs are built with -D options (element type, GEMM tile sizes chosen per device type) and
kept with their Kernel objects; a build error shows the build log and the file.

Every kernel of the interface runs here, so every layer of lamina does; `Network.to('opencl')`
refuses, by name, a layer that calls numpy on its arrays (Layer.needs_host_arrays).
"""
import importlib.resources
import os
import threading
import weakref
from pathlib import Path

import numpy as np

from ..errors import OpenCLError
from . import opencl_plan, stepwise
from .base import ACTIVATIONS, POOL_MODES, Backend, check_activation, window_parts
from .checks import select_sizes
from .checks import (check_attention, check_by_column, check_index, check_layer_norm, check_offsets, check_positions,
                     check_selection, gemm_sizes)

KERNEL_DIR = Path(str(importlib.resources.files("lamina.opencl")))
# Tiles of the local-memory GEMM kernel, (TSM, TSN, TSK, WPTM, WPTN): a work-group computes a
# TSM x TSN tile of C with (TSM/WPTM) x (TSN/WPTN) work-items, each a WPTM x WPTN block. A device
# gets the first whose work-group and local tiles it takes (gemm_tiles); LAMINA_OPENCL_TILES
# ("128,128,16,8,8") sets one. A CPU device runs the panel kernels instead (below); its tiles only
# build the tiled kernel.
TILE_CHOICES = ((128, 128, 16, 8, 8), (64, 64, 16, 8, 8), (32, 32, 8, 4, 4))
# CPU devices: RPW rows x (CV vectors of VW) columns of C per work-item over panels of op(B),
# the fastest of the shapes tried on PoCL (with panels against without, other row and vector
# counts)
RPW, VW, CV = 8, 8, 2
LOCAL = 256  # work-group size of 1-D kernels
# A recurrence's steps after the first run as one recorded plan enqueued by compiled code
# (opencl_plan); False runs them one by one from Python (the tests compare the two)
WHOLE_SEQUENCE = True


def _cl():
    try:
        import pyopencl as cl
        import pyopencl.array  # noqa: F401
        import pyopencl.tools  # noqa: F401
    except ImportError as e:
        raise OpenCLError(f"the OpenCL backend needs pyopencl: pip install 'lamina[opencl]' ({e})") from None
    return cl


def devices():
    """Every OpenCL device of every platform, in the order 'opencl:N' counts them."""
    cl = _cl()
    try:
        return [d for p in cl.get_platforms() for d in p.get_devices()]
    except cl.Error:
        return []


def _pick(device):
    cl = _cl()
    found = devices()
    if not found:
        raise OpenCLError("no OpenCL device found (pip install 'pyopencl[pocl]' gives a CPU device)")
    if device is None and os.environ.get("PYOPENCL_CTX"):
        return cl.create_some_context(interactive=False).devices[0]
    if device is None:
        gpus = [d for d in found if d.type & cl.device_type.GPU]
        return (gpus or found)[0]
    index = int(str(device).split(":")[-1]) if str(device).split(":")[-1].isdigit() else None
    if index is None or not 0 <= index < len(found):
        raise OpenCLError(f"OpenCL device {device!r}: expected an index in 0..{len(found) - 1} "
                          f"({', '.join(d.name.strip() for d in found)})")
    return found[index]


class OpenCLBackend(Backend):
    name = "opencl"

    def __init__(self, device=None):
        cl = self.cl = _cl()
        self.device = _pick(device)
        self.context = cl.Context([self.device])
        self.queue = cl.CommandQueue(self.context)
        self.pool = cl.tools.MemoryPool(cl.tools.ImmediateAllocator(self.queue))
        from . import opencl_array  # (imports pyopencl.array: only once pyopencl is known to be there)
        self._arrays = opencl_array
        self.fp64 = bool(self.device.double_fp_config)
        kind = "gpu" if self.device.type & cl.device_type.GPU else "cpu" if self.device.type & cl.device_type.CPU else "other"
        self.tiles = gemm_tiles(self.device)
        self.cpu_device = kind == "cpu"
        self._programs, self._built = {}, {}
        self._plan_kernels = {}  # (program key, kernel name, launch) -> a Kernel object of a recorded plan's own
        self._stepwise_only = set()  # (cell class, cell name, step) whose step code cannot be recorded
        self._local = threading.local()  # .plan: the plan this thread records, or None
        # host <-> device transfers since the backend was made (from_host, to_host: every one
        # the backend makes goes through them)
        self.transfers = {"to_device": 0, "to_host": 0, "bytes": 0}
        self._host_ids = {}  # (id(host array), tag, dtype) -> (weak reference, snapshot, device copy)
        self._dummies = {}  # dtype -> placeholder array
        # one queue and shared Kernel objects: setting a kernel's arguments and enqueueing it,
        # building a program and allocating from the pool happen under this lock, so threads
        # sharing the backend never interleave them
        self._lock = threading.RLock()

    def __repr__(self):
        return f"OpenCLBackend({self.device.name.strip()!r})"

    # -- programs
    def _program(self, name, dtype):
        dtype = np.dtype(dtype)
        key = (name, dtype, self.tiles)
        if key not in self._programs:
            if dtype == np.float64 and not self.fp64:
                raise OpenCLError(f"{self.device.name.strip()} has no float64 support")
            path = KERNEL_DIR / f"{name}.cl"
            tsm, tsn, tsk, wptm, wptn = self.tiles
            options = [f"-DREAL={'double' if dtype == np.float64 else 'float'}", f"-DTSM={tsm}", f"-DTSN={tsn}",
                       f"-DTSK={tsk}", f"-DWPTM={wptm}", f"-DWPTN={wptn}", f"-DRPW={RPW}",
                       f"-DVW={self._vector_width(dtype)}", f"-DCV={CV}"]
            if dtype == np.float64:
                options.append("-DUSE_DOUBLE")
            # common.h goes in as text, not through -I: driver caches key on the source they see
            source = path.read_text().replace('#include "common.h"', (KERNEL_DIR / "common.h").read_text())
            program = self.cl.Program(self.context, source)
            try:
                program.build(options=options)
            except self.cl.RuntimeError as e:
                try:
                    log = program.get_build_info(self.device, self.cl.program_build_info.LOG)
                except self.cl.Error:
                    log = ""
                hint = ("\n(the device's compiler does not know this CPU: its LLVM is older than the processor; "
                        "a newer PoCL, or another OpenCL driver, is needed here)"
                        if "unknown target CPU" in f"{log}{e}" else "")
                raise OpenCLError(f"building {path} ({' '.join(options)}) for {self.device.name.strip()} "
                                  f"failed:\n{log or e}{hint}") from None
            kernels = {k.function_name: k for k in program.all_kernels()}
            self._built[key] = program
            if not kernels:
                raise OpenCLError(f"building {path} for {self.device.name.strip()} gave no kernels:\n"
                                  f"{program.get_build_info(self.device, self.cl.program_build_info.LOG)}")
            self._programs[key] = kernels
        return self._programs[key]

    @staticmethod
    def _vector_width(dtype):
        """Vector width of the CPU-device GEMMs: VW floats, or as many doubles in the same 32
        bytes (wider double vectors break PoCL's code generation without AVX-512)."""
        return VW if np.dtype(dtype) == np.float32 else max(1, VW // 2)

    def _kernel(self, file, name, dtype):
        return self._program(file, dtype)[name]

    def _run(self, file, name, dtype, global_size, *args, local=None, hoist=False):
        """Launch a kernel; an array argument becomes (buffer, offset in elements), as every
        kernel but the GEMMs takes them. While this thread records a plan (opencl_plan) the launch
        is recorded instead, unless `hoist`: a launch that reads nothing the plan writes runs now,
        once."""
        flat = []
        for a in args:
            if isinstance(a, (self.cl.array.Array, opencl_plan.StepBlock)):
                flat += [a.base_data, np.int32(a.offset // a.dtype.itemsize)]
            else:
                flat.append(a)
        plan = getattr(self._local, "plan", None)
        with self._lock:
            if plan is not None and not hoist:
                self._program(file, dtype)
                plan.add((file, np.dtype(dtype), self.tiles), name, global_size, local, flat)
                return
            self._kernel(file, name, dtype)(self.queue, global_size, local, *flat)

    def _plan_kernel(self, program, name, launch):
        """A Kernel object of its own for launch `launch` of recorded plans (a plan sets its
        constant arguments once, so no other launch may share it)."""
        key = (program, name, launch)
        if key not in self._plan_kernels:
            self._plan_kernels[key] = self.cl.Kernel(self._built[program], name)
        return self._plan_kernels[key]

    def _not_while_recording(self, what):
        if getattr(self._local, "plan", None) is not None:
            raise opencl_plan.NotRecordable(what)

    def _real(self, dtype, value):
        return np.dtype(dtype).type(value)

    @staticmethod
    def _global(n):
        return (_at_least_one(-(-n // LOCAL) * LOCAL),)

    @staticmethod
    def _grid(rows, cols, tile=16):
        return (_at_least_one(-(-cols // tile) * tile), _at_least_one(-(-rows // tile) * tile))

    # -- arrays
    def empty(self, shape, dtype):
        with self._lock:
            return self._arrays.empty(self.queue, tuple(shape), np.dtype(dtype), self.pool)

    def scratch(self, name, shape, dtype):
        if any(isinstance(n, np.ndarray) for n in shape):
            raise opencl_plan.NotRecordable("a scratch array of a size per step")
        return super().scratch(name, shape, dtype)

    def fill(self, a, value):
        self._not_while_recording("fill")
        with self._lock:
            a.fill(a.dtype.type(value))

    def from_host(self, array, wait=True):
        """A device copy of a host array; wait=False returns before the copy has run, and the
        caller must not change the host array (it is read when the queue gets to the copy)."""
        array = np.ascontiguousarray(array)
        with self._lock:
            self._count_transfer("to_device", array.nbytes)
            return self._arrays.to_device(self.queue, array, self.pool, wait)

    def to_host(self, a):
        self._not_while_recording("to_host")
        with self._lock:
            self._count_transfer("to_host", a.nbytes)
            return a.get()

    def _count_transfer(self, direction, nbytes):
        self.transfers[direction] += 1
        self.transfers["bytes"] += int(nbytes)

    def copy(self, src, dst):
        self._not_while_recording("copy")
        if src.shape != dst.shape or src.dtype != dst.dtype:
            raise ValueError(f"copy: dst {dst.shape} {dst.dtype} must match src {src.shape} {src.dtype}")
        with self._lock:
            self.cl.enqueue_copy(self.queue, dst.base_data, src.base_data, byte_count=src.nbytes,
                                 src_offset=src.offset, dst_offset=dst.offset)

    # -- products
    def gemm(self, a, b, c, trans_a=False, trans_b=False, alpha=1.0, beta=0.0):
        for name, x in (("a", a), ("b", b), ("c", c)):
            if x.ndim != 2 or x.dtype != c.dtype:
                raise ValueError(f"gemm: {name} must be a 2-D {c.dtype} array, found {x.dtype} {x.shape}")
        m, n, k = gemm_sizes("gemm", a, b, c, trans_a, trans_b)
        if m == 0 or n == 0:
            return
        size, real = c.dtype.itemsize, c.dtype.type
        args = (np.int32(m), np.int32(n), np.int32(k), real(alpha),
                a.base_data, np.int32(a.offset // size), np.int32(a.strides[0] // size), np.int32(trans_a),
                b.base_data, np.int32(b.offset // size), np.int32(b.strides[0] // size), np.int32(trans_b),
                real(beta), c.base_data, np.int32(c.offset // size), np.int32(c.strides[0] // size))
        if self.cpu_device:  # no local memory, registers blocks of C per work-item (see gemm.cl)
            vw = self._vector_width(c.dtype)
            c_ok = (c.offset // size) % vw == 0 and (c.strides[0] // size) % vw == 0
            if not trans_a and n % vw == 0 and c_ok:
                pw = CV * vw
                panels = -(-n // pw)
                packed = self.empty((panels * k * pw,), c.dtype)
                self._run("gemm", "pack_panels", c.dtype, self._grid(k, panels * pw), b.base_data,
                          np.int32(b.offset // size), np.int32(b.strides[0] // size), np.int32(trans_b),
                          np.int32(k), np.int32(n), packed.data, local=(16, 16),
                          hoist=not isinstance(b, opencl_plan.StepBlock))
                self._run("gemm", "gemm_panels", c.dtype, (-(-m // RPW), panels), np.int32(m), np.int32(n),
                          np.int32(k), real(alpha), a.base_data, np.int32(a.offset // size),
                          np.int32(a.strides[0] // size), packed.data, real(beta), c.base_data,
                          np.int32(c.offset // size), np.int32(c.strides[0] // size), local=(1, 1))
            elif n % vw == 0 and not trans_b and c_ok and all(
                    v % vw == 0 for v in (b.offset // size, b.strides[0] // size)):
                self._run("gemm", "gemm_rows8", c.dtype, (n // vw, -(-m // RPW)), *args, local=None)
            else:
                self._run("gemm", "gemm_rows", c.dtype, (-(-n // 64) * 64, -(-m // RPW)), *args, local=(64, 1))
            return
        tsm, tsn, _, wptm, wptn = self.tiles
        gs = (-(-n // tsn) * (tsn // wptn), -(-m // tsm) * (tsm // wptm))
        self._run("gemm", "gemm", c.dtype, gs, *args, local=(tsn // wptn, tsm // wptm))

    def add_bias(self, y, b):
        y2 = _rows(y)
        self._run("elementwise", "add_bias", y.dtype, self._grid(*y2.shape), y, b,
                  np.int32(y2.shape[0]), np.int32(y2.shape[1]), local=(16, 16))

    def bias_grad(self, dy, db, beta=0.0):
        d2 = _rows(dy)
        self._run("elementwise", "bias_grad", dy.dtype, self._global(d2.shape[1]), dy, db,
                  dy.dtype.type(beta), np.int32(d2.shape[0]), np.int32(d2.shape[1]))

    # -- element-wise
    def activation(self, kind, x, y, slope=0.01):
        check_activation(kind, "activation")
        if kind in ("softmax", "log_softmax"):
            x2 = _last_axis(x)
            self._run("elementwise", "softmax_rows", x.dtype, self._global(x2.shape[0]), x, y,
                      np.int32(x2.shape[0]), np.int32(x2.shape[1]), np.int32(kind == "log_softmax"))
            return
        self._run("elementwise", "activation", x.dtype, self._global(x.size), np.int32(ACTIVATIONS.index(kind)),
                  x, y, x.dtype.type(slope), np.int32(x.size))

    def activation_backward(self, kind, y, dy, dx, beta=0.0, slope=0.01):
        check_activation(kind, "activation_backward")
        if kind in ("softmax", "log_softmax"):
            y2 = _last_axis(y)
            self._run("elementwise", "softmax_rows_backward", y.dtype, self._global(y2.shape[0]), y,
                      dy, dx, y.dtype.type(beta), np.int32(y2.shape[0]), np.int32(y2.shape[1]),
                      np.int32(kind == "log_softmax"))
            return
        self._run("elementwise", "activation_backward", y.dtype, self._global(y.size),
                  np.int32(ACTIVATIONS.index(kind)), y, dy, dx,
                  y.dtype.type(beta), y.dtype.type(slope), np.int32(y.size))

    def axpby(self, alpha, x, beta, y):
        self._run("elementwise", "axpby", y.dtype, self._global(y.size), y.dtype.type(alpha), x,
                  y.dtype.type(beta), y, np.int32(y.size))

    def multiply(self, a, b, out, beta=0.0):
        self._run("elementwise", "multiply", out.dtype, self._global(out.size), a, b,
                  out, out.dtype.type(beta), np.int32(out.size))

    def select(self, cond, a, b, out):
        na, nb = select_sizes(cond, a, b, out)
        self._run("elementwise", "select_values", out.dtype, self._global(out.size), cond, a, np.int32(na), b, np.int32(nb),
                  out, np.int32(out.size))

    def round_to_bfloat16(self, x, y):
        if x.dtype != np.float32 or y.dtype != np.float32 or x.shape != y.shape:
            raise TypeError(f"round_to_bfloat16: x and y must be float32 of one shape, found {x.dtype} {x.shape} "
                            f"and {y.dtype} {y.shape}")
        self._run("elementwise", "round_to_bfloat16", x.dtype, self._global(x.size), x.base_data,
                  np.int32(x.offset // 4), y.base_data, np.int32(y.offset // 4), np.int32(x.size))

    def quantize_rows(self, x, q, scales, levels, symmetric=False):
        if x.dtype != np.float32 or x.ndim != 2 or q.shape != x.shape or q.dtype != x.dtype \
                or scales.shape != (x.shape[0],) or scales.dtype != x.dtype:
            raise TypeError(f"quantize_rows: x and q must be 2-D float32 of one shape and scales float32 of x's rows, "
                            f"found x {x.dtype} {x.shape}, q {q.dtype} {q.shape}, scales {scales.dtype} {scales.shape}")
        self._run("elementwise", "quantize_rows", x.dtype, self._global(x.shape[0]), x, q, scales,
                  np.int32(x.shape[0]), np.int32(x.shape[1]), np.int32(levels), np.int32(bool(symmetric)))

    @staticmethod
    def _square_groups(x, rows):
        """(work-groups, values, row width) of sum_squares over x (or its rows)."""
        width = x.size // x.shape[0] if x.ndim else 1
        n = x.size if rows is None else len(rows) * width
        return min(64, max(1, -(-n // LOCAL))), n, width

    def _sum_squares_into(self, x, rows, partial):
        """Each work-group's sum of squares of x (or its rows) into partial [groups] (on the device)."""
        groups, n, width = self._square_groups(x, rows)
        ids = self._ids(rows, "sum_squares", "rows", x.shape[0]) if rows is not None else self._dummy(np.int32)
        self._run("elementwise", "sum_squares", x.dtype, (groups * LOCAL,), x, ids, np.int32(rows is not None),
                  np.int32(width), np.int32(x.shape[0] if x.ndim else 1), partial, np.int32(n),
                  self.cl.LocalMemory(LOCAL * x.dtype.itemsize), local=(LOCAL,))

    def sum_squares(self, x, rows=None):
        partial = self.empty((self._square_groups(x, rows)[0],), x.dtype)
        self._sum_squares_into(x, rows, partial)
        return float(self.to_host(partial).astype(np.float64).sum())

    reads_wait = True

    def sums_of_squares(self, arrays):
        """One read for all: each array's work-group sums into one buffer per element type."""
        sums = [0.0] * len(arrays)
        for dtype in {x.dtype for x, _ in arrays}:
            members = [(i, x, rows) for i, (x, rows) in enumerate(arrays) if x.dtype == dtype]
            groups = [self._square_groups(x, rows)[0] for _, x, rows in members]
            partial = self.empty((sum(groups),), dtype)
            at = np.concatenate([[0], np.cumsum(groups)])
            for (_, x, rows), a, b in zip(members, at[:-1], at[1:]):
                self._sum_squares_into(x, rows, partial[int(a):int(b)])
            host = self.to_host(partial).astype(np.float64)
            for (i, _, _), a, b in zip(members, at[:-1], at[1:]):
                sums[i] = float(host[a:b].sum())
        return sums

    def gather_rows(self, src, index, dst, col=0):
        s2, d2 = _rows(src), _rows(dst)
        self._run("elementwise", "gather_rows", dst.dtype, self._grid(*d2.shape), src, np.int32(s2.shape[0]),
                  np.int32(s2.shape[1]), self._ids(index, "gather_rows", "index", s2.shape[0]), dst,
                  np.int32(d2.shape[0]), np.int32(d2.shape[1]), np.int32(col), local=(16, 16))

    def scatter_rows(self, src, index, dst, beta=0.0, col=0):
        s2, d2 = _rows(src), _rows(dst)
        self._run("elementwise", "scatter_rows", dst.dtype, self._grid(*s2.shape), src,
                  self._ids(index, "scatter_rows", "index", d2.shape[0]), dst, np.int32(d2.shape[0]),
                  np.int32(d2.shape[1]), dst.dtype.type(beta),
                  np.int32(s2.shape[0]), np.int32(s2.shape[1]), np.int32(col), local=(16, 16))

    def scatter_add_rows(self, src, ids, dst):
        s2 = _rows(src)
        self._run("elementwise", "scatter_add_rows", dst.dtype, self._global(s2.shape[1]), src,
                  self._ids(ids, "scatter_add_rows", "ids", dst.shape[0]), dst, np.int32(dst.shape[0]),
                  np.int32(s2.shape[0]), np.int32(s2.shape[1]))

    def fill_rows(self, dst, rows, value):
        d2 = _rows(dst)
        if len(rows):
            self._run("elementwise", "fill_rows", dst.dtype, self._grid(len(rows), d2.shape[1]), dst,
                      self._ids(rows, "fill_rows", "rows", d2.shape[0]), dst.dtype.type(value),
                      np.int32(d2.shape[0]), np.int32(len(rows)), np.int32(d2.shape[1]), local=(16, 16))

    def _optional(self, a, dtype):
        """An optional array argument as the kernels take it: (the array, 1), or (a placeholder,
        0) for None. Host arrays (row weights, logQ shifts) are copied to the device once."""
        if a is not None:
            return self._device(a, dtype), np.int32(1)
        return self._dummy(dtype), np.int32(0)

    def _dummy(self, dtype):
        """A one-element placeholder for an absent array argument."""
        dtype = np.dtype(dtype)
        if dtype not in self._dummies:
            self._dummies[dtype] = self.empty((1,), dtype)
        return self._dummies[dtype]

    def _ids(self, ids, where, name, bound):
        """int32 ids in [0, bound) on the device (see _device); host ids are checked here, device
        ids by the kernels that read them."""
        return self._device(ids, np.int32, check=lambda a: check_index(where, name, a, bound))

    def _offsets(self, starts, where, total):
        """int32 offsets from 0 to `total` on the device (see _ids)."""
        return self._device(starts, np.int32, check=lambda a: check_offsets(where, "starts", a, total))

    def _device(self, host, dtype, derive=None, tag=None, check=None):
        """A device copy of a host array (or of derive(host)), made once and kept while the host
        array lives and holds the same values: a batch's time-major order, a selection's columns
        or label positions are computed on the host once per batch, from the caller's feeds, and
        copied once. (A host array changed in place is noticed and copied again.) The host values
        are snapshot first; `check` and `derive` see the snapshot, and the device gets what they saw."""
        if not isinstance(host, np.ndarray):
            return host
        key = (id(host), tag, np.dtype(dtype))
        with self._lock:
            hit = self._host_ids.get(key)
        if hit is not None and hit[0]() is host and np.array_equal(hit[1], host):
            snapshot, device = hit[1], hit[2]
        else:
            snapshot = host.copy()
            value = derive(snapshot) if derive is not None else snapshot
            if check is not None:
                check(value)
            # (without waiting: the queue may be busy with what was enqueued before, and the
            # values uploaded are made from the snapshot, this call's own copy, never changed)
            device = self.from_host(np.ascontiguousarray(value, dtype=dtype), wait=False)
            with self._lock:
                if len(self._host_ids) > 256:  # bounded: the dead, then the oldest half
                    live = [(k, v) for k, v in self._host_ids.items() if v[0]() is not None]
                    self._host_ids = dict(live[len(live) // 2:] if len(live) > 128 else live)
                self._host_ids[key] = (weakref.ref(host), snapshot, device, value)
            return device
        if check is not None:
            check(hit[3])
        return device

    def bernoulli_mask(self, mask, keep, rng):
        if not 0 < keep <= 1:
            raise ValueError(f"bernoulli_mask: keep must be in (0, 1], found {keep}")
        seed = np.uint32(rng.integers(0, 2 ** 32, dtype=np.uint64))
        self._run("elementwise", "bernoulli_mask", mask.dtype, self._global(mask.size), mask,
                  mask.dtype.type(keep), seed, np.int32(mask.size))

    # -- volumes (one sample [C, D, H, W]; see Backend.vol2col)
    def _volume_args(self, x, col, geometry, rows):
        kernel, stride, padding, dilation, grid = geometry
        r0, r1 = rows if rows is not None else (0, grid[0] * grid[1])
        return [np.int32(v) for v in (*kernel, *stride, *padding, *dilation, *grid, r0, r1)], r1 - r0

    def resample_axis(self, x, taps, weights, y):
        outer, n, inner = x.shape
        m, k = taps.shape
        self._run("volumes", "resample_axis", x.dtype, self._grid(outer * m, inner), x,
                  self._ids(taps, "resample_axis", "taps", n), self._device(weights, x.dtype), y,
                  *[np.int32(v) for v in (outer, n, m, inner, k)], local=(16, 16))

    def resample_axis_backward(self, dy, taps, weights, dx, beta=0.0):
        outer, n, inner = dx.shape
        m, k = taps.shape
        self._run("volumes", "resample_axis_backward", dy.dtype, self._grid(outer, inner), dy,
                  self._ids(taps, "resample_axis_backward", "taps", n), self._device(weights, dy.dtype), dx,
                  dy.dtype.type(beta), *[np.int32(v) for v in (outer, n, m, inner, k)], local=(16, 16))

    def vol2col(self, x, col, geometry, rows=None):
        args, nrows = self._volume_args(x, col, geometry, rows)
        cols = nrows * geometry[4][2]
        self._run("volumes", "vol2col", x.dtype, self._grid(col.shape[0], cols), x,
                  *[np.int32(v) for v in x.shape], col, *args, local=(16, 16))

    def col2vol(self, col, x, geometry, rows=None):
        args, _ = self._volume_args(x, col, geometry, rows)
        self._run("volumes", "col2vol", x.dtype, self._global(x.size), col, x, *[np.int32(v) for v in x.shape],
                  *args)

    def channel_bias(self, y, b, beta=1.0):
        N, C, S = y.shape[0], y.shape[1], y.size // (y.shape[0] * y.shape[1])
        self._run("volumes", "channel_bias", y.dtype, self._grid(N * C, S), y, b, y.dtype.type(beta), np.int32(N),
                  np.int32(C), np.int32(S), local=(16, 16))

    def channel_bias_grad(self, dy, db, beta=0.0):
        N, C, S = dy.shape[0], dy.shape[1], dy.size // (dy.shape[0] * dy.shape[1])
        self._run("volumes", "channel_bias_grad", dy.dtype, self._global(C), dy, db, dy.dtype.type(beta),
                  np.int32(N), np.int32(C), np.int32(S))

    # -- pooling: x [N, C, *spatial] as planes [N·C, D, H, W]; window = (kernel, stride, padding)
    @staticmethod
    def _plane_shape(a):
        spatial = (1,) * (5 - a.ndim) + tuple(a.shape[2:])
        return [np.int32(a.shape[0] * a.shape[1])] + [np.int32(v) for v in spatial]

    @staticmethod
    def _window_args(window):
        return [np.int32(v) for part in window_parts(window) for v in part]

    def max_pool(self, x, out, argmax, window):
        P, D, H, W = self._plane_shape(x)
        # argmax, then keep_argmax; without one, a null buffer at offset 0 and keep_argmax 0
        positions = (argmax, np.int32(1)) if argmax is not None else (None, np.int32(0), np.int32(0))
        self._run("volumes", "max_pool", x.dtype, self._global(out.size), x, out, *positions, P, D, H, W,
                  *self._plane_shape(out)[1:], *self._window_args(window))

    def max_pool_backward(self, dy, argmax, dx, beta=0.0, window=None):
        if window is None:
            raise ValueError("max_pool_backward: the OpenCL kernel gathers per input element and needs the window")
        self._run("volumes", "max_pool_backward", dy.dtype, self._global(dx.size), dy, argmax, dx,
                  dy.dtype.type(beta), *self._plane_shape(dx), *self._plane_shape(dy)[1:],
                  *self._window_args(window))

    def avg_pool(self, x, out, window, count_include_pad=True):
        self._run("volumes", "avg_pool", x.dtype, self._global(out.size), x, out, *self._plane_shape(x),
                  *self._plane_shape(out)[1:], *self._window_args(window), np.int32(count_include_pad))

    def avg_pool_backward(self, dy, dx, window, count_include_pad=True, beta=0.0):
        self._run("volumes", "avg_pool_backward", dy.dtype, self._global(dx.size), dy, dx, dy.dtype.type(beta),
                  *self._plane_shape(dx), *self._plane_shape(dy)[1:], *self._window_args(window),
                  np.int32(count_include_pad))

    # -- batch normalisation: x [N, C, *spatial]; statistics are C values of x's type here
    def stat_dtype(self, dtype):
        return np.dtype(dtype)

    @staticmethod
    def _ncs_shape(x):
        return [np.int32(x.shape[0]), np.int32(x.shape[1]), np.int32(x.size // (x.shape[0] * x.shape[1]))]

    def batch_norm_stats(self, x, mean, var):
        self._run("volumes", "batch_norm_stats", x.dtype, self._global(x.shape[1]), x, mean, var, *self._ncs_shape(x))

    def batch_norm_statistics(self, mean, var, invstd, running_mean, running_var, eps, momentum, count, training):
        r = mean.dtype.type
        self._run("volumes", "batch_norm_statistics", mean.dtype, self._global(len(mean)), mean, var, invstd,
                  running_mean, running_var, r(eps), r(momentum), r(count / max(count - 1, 1)), np.int32(training),
                  np.int32(len(mean)))

    def batch_norm_apply(self, x, mean, invstd, gamma, beta, y, activation=None):
        affine = gamma is not None
        dummy = self._dummy(x.dtype)
        relu = activation is not None and activation[0] == "relu"  # in the same pass; others after
        self._run("volumes", "batch_norm_apply", x.dtype, self._global(x.size), x, mean, invstd,
                  gamma if affine else dummy, beta if affine else dummy, np.int32(affine), np.int32(relu), y,
                  *self._ncs_shape(x))
        if not relu:
            self.activate_in_place(activation, y)

    def batch_norm_backward(self, x, dy, mean, invstd, gamma, batch_stats, dx, beta, dgamma, dbeta):
        shape = self._ncs_shape(x)
        self._run("volumes", "batch_norm_sums", x.dtype, self._global(x.shape[1]), x, dy, mean, invstd, dgamma, dbeta,
                  *shape)
        if dx is not None:
            affine = gamma is not None
            self._run("volumes", "batch_norm_dx", x.dtype, self._global(x.size), x, dy, mean, invstd,
                      gamma if affine else self._dummy(x.dtype), np.int32(affine), np.int32(batch_stats), dgamma,
                      dbeta, dx, x.dtype.type(beta), *shape)

    def add_cast(self, src, dst, beta=0.0):
        self.axpby(1.0, src, beta, dst)

    # -- sequences (starts are host offsets, copied once per batch by _ids)
    def sequence_pool(self, mode, x, starts, out, argmax):
        x2, o2 = _rows(x), _rows(out)
        self._run("sequences", "sequence_pool", x.dtype, self._grid(*o2.shape), np.int32(POOL_MODES.index(mode)),
                  x2, self._offsets(starts, "sequence_pool", x2.shape[0]), o2, argmax, np.int32(o2.shape[0]), np.int32(o2.shape[1]), local=(16, 16))

    def sequence_pool_backward(self, mode, dy, starts, argmax, dx, beta=0.0):
        d2 = _rows(dy)
        self._run("sequences", "sequence_pool_backward", dy.dtype, self._grid(*d2.shape),
                  np.int32(POOL_MODES.index(mode)), d2, self._offsets(starts, "sequence_pool_backward", dx.shape[0]),
                  argmax, _rows(dx), dy.dtype.type(beta), np.int32(d2.shape[0]), np.int32(d2.shape[1]),
                  local=(16, 16))

    def sequence_softmax(self, x, starts, y):
        n = len(starts) - 1
        self._run("sequences", "sequence_softmax", x.dtype, self._global(n), x,
                  self._offsets(starts, "sequence_softmax", x.size), y, np.int32(n))

    def sequence_softmax_backward(self, y, dy, starts, dx, beta=0.0):
        n = len(starts) - 1
        self._run("sequences", "sequence_softmax_backward", y.dtype, self._global(n), y, dy,
                  self._offsets(starts, "sequence_softmax_backward", y.size), dx,
                  y.dtype.type(beta), np.int32(n))

    # -- attention within sequences, layer normalization (attention.cl)
    def attention(self, qkv, starts, heads, scale, causal, out, lse):
        rows, E = out.shape
        check_attention("attention", qkv, starts, heads, out, lse)
        self._run("attention", "attention", out.dtype, self._grid(rows, heads), qkv,
                  self._offsets(starts, "attention", rows), out, lse, out.dtype.type(scale), np.int32(causal),
                  np.int32(len(starts) - 1), np.int32(rows), np.int32(heads), np.int32(E), local=(16, 16))

    def attention_backward(self, qkv, out, lse, dout, starts, heads, scale, causal, dqkv):
        rows, E = out.shape
        check_attention("attention_backward", qkv, starts, heads, out, lse, dout=dout, dqkv=dqkv)
        starts_d, delta = self._offsets(starts, "attention_backward", rows), self.scratch("delta", lse.shape, lse.dtype)
        sizes = [out.dtype.type(scale), np.int32(causal), np.int32(len(starts) - 1), np.int32(rows), np.int32(heads),
                 np.int32(E)]
        self._run("attention", "attention_backward_query", out.dtype, self._grid(rows, heads), qkv, out, lse, dout,
                  starts_d, dqkv, delta, *sizes, local=(16, 16))
        self._run("attention", "attention_backward_key", out.dtype, self._grid(rows, heads), qkv, lse, dout,
                  starts_d, delta, dqkv, *sizes, local=(16, 16))

    def layer_norm(self, x, gamma, beta, eps, y, mean, rstd, center=True):
        check_layer_norm("layer_norm", x, mean, rstd, {"gamma": gamma, "beta": beta}, {"y": y})
        rows, C = x.shape
        self._run("attention", "layer_norm", x.dtype, self._global(rows), x, _or(gamma, x), _or(beta, x), y, mean,
                  rstd, x.dtype.type(eps), np.int32(center), np.int32(gamma is not None), np.int32(beta is not None),
                  np.int32(rows), np.int32(C))

    def layer_norm_backward(self, x, dy, mean, rstd, gamma, dx=None, dx_beta=0.0, dgamma=None, dgamma_beta=0.0,
                            dbeta=None, dbeta_beta=0.0, center=True):
        check_layer_norm("layer_norm_backward", x, mean, rstd, {"gamma": gamma, "dgamma": dgamma, "dbeta": dbeta},
                         {"dy": dy, "dx": dx})
        rows, C = x.shape
        r = x.dtype.type
        if dx is not None:
            self._run("attention", "layer_norm_backward", x.dtype, self._global(rows), x, dy, mean, rstd,
                      _or(gamma, x), dx, r(dx_beta), np.int32(center), np.int32(gamma is not None), np.int32(rows),
                      np.int32(C))
        if dgamma is not None or dbeta is not None:
            self._run("attention", "layer_norm_param_grads", x.dtype, self._global(C), x, dy, mean, rstd,
                      _or(dgamma, x), r(dgamma_beta), _or(dbeta, x), r(dbeta_beta), np.int32(dgamma is not None),
                      np.int32(dbeta is not None), np.int32(rows), np.int32(C))

    # -- optimizer updates of listed rows (sparse gradients)
    def sgd_update_rows(self, p, g, v, rows, lr, momentum=0.0, dampening=0.0, nesterov=False):
        r, cols = p.dtype.type, p.size // p.shape[0]
        if len(rows):
            self._run("sequences", "sgd_update_rows", p.dtype, self._grid(len(rows), cols), p, g,
                      v if momentum else p, self._ids(rows, "sgd_update_rows", "rows", p.shape[0]), r(lr),
                      r(momentum), r(dampening), np.int32(nesterov),
                      np.int32(len(rows)), np.int32(cols), local=(16, 16))

    def adagrad_update_rows(self, p, g, s, rows, lr, eps):
        r, cols = p.dtype.type, p.size // p.shape[0]
        if len(rows):
            self._run("sequences", "adagrad_update_rows", p.dtype, self._grid(len(rows), cols), p, g, s,
                      self._ids(rows, "adagrad_update_rows", "rows", p.shape[0]), r(lr), r(eps),
                      np.int32(len(rows)), np.int32(cols), local=(16, 16))

    def adam_update_rows(self, p, g, m, v, rows, lr, beta1, beta2, eps, step):
        if step < 1:
            raise ValueError(f"adam_update_rows: step counts from 1, found {step}")
        r, cols = p.dtype.type, p.size // p.shape[0]
        c1, c2 = 1 - beta1 ** step, 1 - beta2 ** step
        if len(rows):
            self._run("sequences", "adam_update_rows", p.dtype, self._grid(len(rows), cols), p, g, m, v,
                      self._ids(rows, "adam_update_rows", "rows", p.shape[0]), r(beta1), r(beta2), r(eps),
                      r(lr / c1), r(np.sqrt(c2)), np.int32(len(rows)),
                      np.int32(cols), local=(16, 16))

    # -- selections: the CSC arrays come from lamina.Selection.by_column (host, once per batch)
    def _host(self, a):
        return a if isinstance(a, np.ndarray) else self.to_host(a)

    def _csc(self, where, by_column, entries, rows, width):
        """The CSC arrays on the device, checked to index `entries` values, `rows` input rows and
        `width` weight rows."""
        by_column = [self._host(a) for a in by_column]
        check_by_column(where, by_column, entries, rows, width)
        columns, bucket, entry_ids, entry_rows = by_column
        cols_of_k = self._device(entry_ids, np.int32, lambda _: np.repeat(columns, np.diff(bucket)), "cols_of_k")
        return [self._device(a, np.int32) for a in by_column] + [cols_of_k]

    def _csr(self, by_column, rows):
        """(starts, cols) of the entries in row order, from the CSC arrays (checked by _csc)."""
        columns, bucket, entries, entry_rows = (self._host(a) for a in by_column)
        starts = self._device(entries, np.int32, lambda _: np.concatenate(
            [[0], np.cumsum(np.bincount(entry_rows, minlength=rows))]), ("starts", rows))
        def cols(_):
            out = np.empty(len(entries), np.int32)
            out[entries] = np.repeat(columns, np.diff(bucket))
            return out
        return starts, self._device(entries, np.int32, cols, "cols")

    def selected_dots(self, x, w, by_column, out, beta=0.0):
        nnz = len(out)
        columns, bucket, entries, entry_rows, cols_of_k = self._csc("selected_dots", by_column, nnz, x.shape[0],
                                                                    w.shape[0])
        self._run("selective", "selected_dots", x.dtype, self._global(nnz), x, w, entries, entry_rows, cols_of_k,
                  out, x.dtype.type(beta), np.int32(nnz), np.int32(x.shape[1]))

    def selected_backward(self, g, x, w, by_column, dx=None, dx_beta=0.0, dw=None, dw_beta=0.0):
        n, r = x.shape[1], g.dtype.type
        columns, bucket, entries, entry_rows, _ = self._csc("selected_backward", by_column, len(g), x.shape[0],
                                                            w.shape[0])
        if dx is not None:
            starts, cols = self._csr(by_column, x.shape[0])
            self._run("selective", "selected_input_grad", g.dtype, self._grid(x.shape[0], n), g, w, starts, cols,
                      dx, r(dx_beta), np.int32(x.shape[0]), np.int32(n), local=(16, 16))
        if dw is not None:
            distinct = len(by_column[0])
            self._run("selective", "selected_weight_grad", g.dtype, self._grid(distinct, n), g, x, columns, bucket,
                      entries, entry_rows, dw, r(dw_beta), np.int32(distinct), np.int32(n), local=(16, 16))

    def selected_bias_grad(self, g, by_column, db, beta=0.0):
        columns, bucket, entries, _, _ = self._csc("selected_bias_grad", by_column, len(g), len(g), db.shape[0])
        distinct = len(by_column[0])
        self._run("selective", "selected_bias_grad", g.dtype, self._global(distinct), g, columns, bucket, entries,
                  db, g.dtype.type(beta), np.int32(distinct))

    def add_selected_bias(self, out, b, cols):
        self._run("selective", "add_selected_bias", out.dtype, self._global(len(cols)), out, b,
                  self._ids(cols, "add_selected_bias", "cols", b.shape[0]), np.int32(b.shape[0]), np.int32(len(cols)))

    def gather_entries(self, full, starts, cols, shared, out, beta=0.0):
        rows = full.shape[0]
        starts, cols = self._entries("gather_entries", starts, cols, shared, len(out), full.shape)
        self._run("selective", "gather_entries", full.dtype, self._global(rows), full, starts,
                  cols, np.int32(shared), out, full.dtype.type(beta), np.int32(rows),
                  np.int32(full.shape[1]))

    def scatter_entries(self, g, starts, cols, shared, full):
        rows = full.shape[0]
        starts, cols = self._entries("scatter_entries", starts, cols, shared, len(g), full.shape)
        self._run("selective", "scatter_entries", g.dtype, self._global(rows), g, starts, cols,
                  np.int32(shared), full, np.int32(rows), np.int32(full.shape[1]))

    def _entries(self, where, starts, cols, shared, entries, shape):
        """A selection's (starts, cols) over a [rows, columns] array, checked and on the device."""
        check_selection(where, self._host(starts), self._host(cols), shared, entries, *shape)
        return self._device(starts, np.int32), self._device(cols, np.int32)

    def _segment(self, where, starts, pos, entries):
        """A selection's row offsets and each row's position, checked and on the device."""
        starts_host = self._host(starts)
        check_offsets(where, "starts", starts_host, entries)
        return (self._device(starts, np.int32),
                self._device(pos, np.int32, check=lambda a: check_positions(where, "pos", a, starts_host)))

    def segment_cross_entropy(self, z, starts, pos, shift, w, probs, cost):
        rows = len(starts) - 1
        self._run("selective", "segment_cross_entropy", z.dtype, self._global(rows), z,
                  *self._segment("segment_cross_entropy", starts, pos, len(z)), *self._optional(shift, z.dtype),
                  *self._optional(w, z.dtype), probs, cost, np.int32(rows))

    def segment_cross_entropy_backward(self, probs, starts, pos, w, dcost, dz, beta=0.0):
        rows = len(starts) - 1
        self._run("selective", "segment_cross_entropy_backward", dz.dtype, self._global(rows), probs,
                  *self._segment("segment_cross_entropy_backward", starts, pos, len(probs)),
                  *self._optional(w, dz.dtype), dcost, dz, dz.dtype.type(beta), np.int32(rows))

    def segment_self_normalized(self, o, starts, pos, alpha, w, cost):
        rows = len(starts) - 1
        self._run("selective", "segment_self_normalized", o.dtype, self._global(rows), o,
                  *self._segment("segment_self_normalized", starts, pos, len(o)), o.dtype.type(alpha),
                  *self._optional(w, o.dtype), cost, np.int32(rows))

    def segment_self_normalized_backward(self, o, starts, pos, alpha, w, dcost, do, beta=0.0):
        rows = len(starts) - 1
        self._run("selective", "segment_self_normalized_backward", o.dtype, self._global(rows), o,
                  *self._segment("segment_self_normalized_backward", starts, pos, len(o)), o.dtype.type(alpha),
                  *self._optional(w, o.dtype), dcost, do, o.dtype.type(beta), np.int32(rows))

    # -- recurrent cells (a None state is absent: see _optional)

    # -- the recurrence of a layer direction: the first step from Python, the others recorded
    #    once and enqueued by compiled code (opencl_plan)
    def recurrence_forward(self, cell, ctx, run):
        order = ctx.order
        stepwise.forward_step(cell, ctx, run, *stepwise.step_rows(order, 0), True)
        self._later_steps(cell, ctx, run, stepwise.forward_step, list(range(1, order.steps)),
                          then=lambda: stepwise.store_output(ctx, run))

    def recurrence_backward(self, cell, ctx, run):
        order = ctx.order
        self._later_steps(cell, ctx, run, stepwise.backward_step, list(range(order.steps - 1, 0, -1)))
        stepwise.backward_step(cell, ctx, run, *stepwise.step_rows(order, 0), True)

    def _later_steps(self, cell, ctx, run, step, steps, then=None):
        """`step` (stepwise.forward_step or backward_step) over these steps, in this order, then
        `then()`: as one recorded plan where the step code records (`then` in its last step),
        else one step at a time. Only float32 products from the weights themselves record:
        recording must not be what first makes state that is kept (a weight's pack), because a
        recording that raises NotRecordable drops its launches."""
        key = (type(cell), cell.cell_name, step)
        if len(steps) and WHOLE_SEQUENCE and ctx.precision == "float32" and not cell.uses_packed(self) \
                and key not in self._stepwise_only and opencl_plan.entry_points():
            rows, prev = opencl_plan.step_rows(ctx.order, steps)
            plan = opencl_plan.Plan(len(steps))
            with self._lock:
                self._local.plan = plan
                try:
                    step(cell, ctx, run, rows, prev, False)
                    if then is not None:
                        with plan.at_last_step():
                            then()
                except opencl_plan.NotRecordable:
                    self._stepwise_only.add(key)
                    plan = None
                finally:
                    self._local.plan = None
                if plan is not None:
                    plan.enqueue(self)
                    return
        for t in steps:
            step(cell, ctx, run, *stepwise.step_rows(ctx.order, t), False)
        if then is not None:
            then()

    def lstm_step(self, g, c_prev, c, h):
        rows, H = h.shape
        self._run("cells", "lstm_step", h.dtype, self._grid(rows, H), g, *self._optional(c_prev, h.dtype), c, h,
                  np.int32(rows), np.int32(H), local=(16, 16))

    def lstm_step_backward(self, g, c_prev, c, dh, dc, dg, dc_prev):
        rows, H = dh.shape
        self._run("cells", "lstm_step_backward", dh.dtype, self._grid(rows, H), g, *self._optional(c_prev, dh.dtype),
                  c, dh, dc, dg, *self._optional(dc_prev, dh.dtype), np.int32(rows), np.int32(H), local=(16, 16))

    def gru_step(self, g, hh, h_prev, h):
        rows, H = h.shape
        self._run("cells", "gru_step", h.dtype, self._grid(rows, H), g, hh, *self._optional(h_prev, h.dtype), h,
                  np.int32(rows), np.int32(H), local=(16, 16))

    def gru_step_backward(self, g, hh, h_prev, dh, dgx, dgh, dh_prev):
        rows, H = dh.shape
        self._run("cells", "gru_step_backward", dh.dtype, self._grid(rows, H), g, hh, *self._optional(h_prev, dh.dtype),
                  dh, dgx, dgh, *self._optional(dh_prev, dh.dtype), np.int32(rows), np.int32(H), local=(16, 16))

    # -- costs

    def softmax_cross_entropy(self, x, labels, w, probs, cost):
        if probs is None:  # (the kernel writes them: a scratch)
            probs = self.empty(x.shape, x.dtype)
        x2 = _rows(x)
        self._run("elementwise", "softmax_cross_entropy", x.dtype, self._global(x2.shape[0]), x,
                  self._ids(labels, "softmax_cross_entropy", "labels", x2.shape[1]), *self._optional(w, x.dtype),
                  probs, cost,
                  np.int32(x2.shape[0]), np.int32(x2.shape[1]))

    def softmax_cross_entropy_backward(self, probs, labels, w, dcost, dx, beta=0.0):
        p2 = _rows(probs)
        self._run("elementwise", "softmax_cross_entropy_backward", dx.dtype, self._grid(*p2.shape),
                  probs, self._ids(labels, "softmax_cross_entropy_backward", "labels", p2.shape[1]),
                  *self._optional(w, dx.dtype), dcost,
                  dx, dx.dtype.type(beta), np.int32(p2.shape[0]), np.int32(p2.shape[1]), local=(16, 16))

    def _pair(self, kind, x, t, w, cost):
        x2 = _rows(x)
        self._run("elementwise", "pair_cost", x.dtype, self._global(x2.shape[0]), np.int32(kind), x,
                  t, *self._optional(w, x.dtype), cost, np.int32(x2.shape[0]),
                  np.int32(x2.shape[1]))

    def _pair_backward(self, kind, x, t, w, dcost, dout, wrt_target, beta):
        x2 = _rows(x)
        self._run("elementwise", "pair_cost_backward", x.dtype, self._grid(*x2.shape), np.int32(kind),
                  x, t, *self._optional(w, x.dtype), dcost, dout,
                  np.int32(wrt_target), x.dtype.type(beta), np.int32(x2.shape[0]), np.int32(x2.shape[1]),
                  local=(16, 16))

    def square_error(self, x, t, w, cost):
        self._pair(0, x, t, w, cost)

    def square_error_backward(self, x, t, w, dcost, dout, wrt_target=False, beta=0.0):
        self._pair_backward(0, x, t, w, dcost, dout, wrt_target, beta)

    def bce_with_logits(self, x, t, w, cost):
        self._pair(1, x, t, w, cost)

    def bce_with_logits_backward(self, x, t, w, dcost, dout, wrt_target=False, beta=0.0):
        self._pair_backward(1, x, t, w, dcost, dout, wrt_target, beta)

    # -- optimizer updates
    def sgd_update(self, p, g, v, lr, momentum, dampening, nesterov, weight_decay):
        r = p.dtype.type
        self._run("elementwise", "sgd_update", p.dtype, self._global(p.size), p, g,
                  v if momentum else p, r(lr), r(momentum), r(dampening), np.int32(nesterov),
                  r(weight_decay), np.int32(p.size))

    def adam_update(self, p, g, m, v, lr, beta1, beta2, eps, weight_decay, decoupled, step):
        if step < 1:
            raise ValueError(f"adam_update: step counts from 1, found {step}")
        r = p.dtype.type
        c1, c2 = 1 - beta1 ** step, 1 - beta2 ** step
        self._run("elementwise", "adam_update", p.dtype, self._global(p.size), p, g,
                  m, v, r(lr), r(beta1), r(beta2), r(eps), r(weight_decay),
                  np.int32(decoupled), r(lr / c1), r(np.sqrt(c2)), np.int32(p.size))

    def adagrad_update(self, p, g, s, lr, eps, weight_decay):
        r = p.dtype.type
        self._run("elementwise", "adagrad_update", p.dtype, self._global(p.size), p, g,
                  s, r(lr), r(eps), r(weight_decay), np.int32(p.size))

    def rmsprop_update(self, p, g, s, buf, lr, alpha, eps, weight_decay, momentum):
        r = p.dtype.type
        self._run("elementwise", "rmsprop_update", p.dtype, self._global(p.size), p, g,
                  s, buf if momentum else p, r(lr), r(alpha), r(eps), r(weight_decay),
                  r(momentum), np.int32(p.size))


def gemm_tiles(device):
    """The tiles of the local-memory GEMM for `device` (see TILE_CHOICES)."""
    asked = os.environ.get("LAMINA_OPENCL_TILES", "")
    if asked:
        try:
            tiles = tuple(int(v) for v in asked.split(","))
            tsm, tsn, tsk, wptm, wptn = tiles
        except ValueError:
            tiles = ()
        if len(tiles) != 5 or min(tiles) < 1 or tsm % wptm or tsn % wptn or tsm % 4 or tsn % 4 or tsk % 4:
            raise OpenCLError(f"LAMINA_OPENCL_TILES: expected TSM,TSN,TSK,WPTM,WPTN, positive, TSM, TSN and TSK "
                              f"multiples of 4 (the kernel loads four values at a time), TSM a multiple of WPTM and "
                              f"TSN of WPTN (as 128,128,16,8,8), found {asked!r}")
        return tiles
    for tsm, tsn, tsk, wptm, wptn in TILE_CHOICES:
        group = (tsn // wptn, tsm // wptm)
        local = tsk * (tsm + tsn + 2) * 8  # both tiles, padded, in float64 at most
        if group[0] * group[1] <= device.max_work_group_size and all(
                g <= m for g, m in zip(group, device.max_work_item_sizes)) and local <= device.local_mem_size:
            return tsm, tsn, tsk, wptm, wptn
    return TILE_CHOICES[-1]


def _at_least_one(n):
    """max(n, 1), for a size or a size per step (opencl_plan.PerStep)."""
    return np.maximum(n, 1) if isinstance(n, np.ndarray) else max(n, 1)


def _rows(a):
    """A [rows, features] view of an array with a leading batch axis."""
    return a.reshape(a.shape[0], -1) if a.ndim != 2 else a


def _last_axis(a):
    """A 2-D view of rows along the last axis (softmax normalises each such row)."""
    return a.reshape(a.size // a.shape[-1], a.shape[-1]) if a.ndim != 2 else a


def _or(a, other):
    """An optional array argument: where it is absent (None), another array of the kernel's type
    stands in, and a flag tells the kernel not to read it."""
    return other if a is None else a
