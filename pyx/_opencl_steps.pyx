# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Enqueues a recorded plan of OpenCL kernel launches for many steps from compiled code: the
launches of a recurrence's time steps (lamina.backends.opencl_plan), so a step costs the driver's
enqueue and no Python.

The OpenCL entry points come as addresses (`clSetKernelArg`, `clEnqueueNDRangeKernel` of the
library pyopencl loaded), so this module needs no OpenCL headers or library at build time.
`set_constants` sets each launch's arguments that stay the same over the steps; `enqueue` walks
the steps, sets the int32 arguments that change from step to step and enqueues each launch (a
launch whose global size is 0 in a step is skipped there)."""
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uintptr_t

ctypedef int32_t (*set_arg_f)(void* kernel, uint32_t index, size_t size, const void* value) noexcept nogil
ctypedef int32_t (*enqueue_f)(void* queue, void* kernel, uint32_t dims, const size_t* offset,
                              const size_t* global_size, const size_t* local_size, uint32_t events,
                              const void* wait_list, void* event) noexcept nogil


def set_constants(uintptr_t set_arg, const uint64_t[::1] kernels, const int32_t[:, ::1] args,
                  const int64_t[:, ::1] sizes, const uint64_t[:, ::1] values):
    """Sets each launch's arguments that stay the same over the steps. Launches K, constants C:
    kernels [K], args [K, C] (argument indices, -1 ends a launch's list), sizes [K, C] (bytes: 1
    to 8, or minus the bytes of a local-memory argument), values [K, C] (the value's bytes: a
    memory object's handle, 0 for none, or a scalar). Returns (0, -1, -1), or (the OpenCL error
    code, the launch, the argument) of the first that failed."""
    cdef Py_ssize_t K = kernels.shape[0], C = args.shape[1], k, c
    if args.shape[0] != K or sizes.shape[0] != K or values.shape[0] != K or sizes.shape[1] != C \
            or values.shape[1] != C:
        raise ValueError(f"set_constants: for {K} launches of {C} constants, args, sizes and values must be "
                         f"[{K}, {C}]")
    cdef set_arg_f set_arg_call = <set_arg_f><void*>set_arg
    cdef int32_t err = 0
    cdef Py_ssize_t at_launch = -1, at_arg = -1
    with nogil:
        for k in range(K):
            for c in range(C):
                if args[k, c] < 0:
                    break
                if sizes[k, c] < 0:  # local memory of -size bytes
                    err = set_arg_call(<void*><uintptr_t>kernels[k], <uint32_t>args[k, c], <size_t>(-sizes[k, c]),
                                       NULL)
                elif 0 < sizes[k, c] <= 8:
                    err = set_arg_call(<void*><uintptr_t>kernels[k], <uint32_t>args[k, c], <size_t>sizes[k, c],
                                       &values[k, c])
                else:
                    err = -51  # CL_INVALID_ARG_SIZE
                if err != 0:
                    at_launch, at_arg = k, args[k, c]
                    break
            if err != 0:
                break
    return err, at_launch, at_arg


def enqueue(uintptr_t set_arg, uintptr_t enqueue_kernel, uintptr_t queue, const uint64_t[::1] kernels,
            const int32_t[::1] dims, const int64_t[:, ::1] local, const int64_t[:, :, ::1] global_size,
            const int32_t[:, ::1] patch_args, const int32_t[:, :, ::1] patch_values):
    """Steps S, launches K, patches P: kernels [K] (cl_kernel handles), dims [K] (1 to 3), local
    [K, 3] (0: the driver chooses), global_size [S, K, 3], patch_args [K, P] (argument indices, -1
    ends a launch's list), patch_values [S, K, P]. Returns (0, -1, -1), or (the OpenCL error code,
    the step, the launch) of the first call that failed; nothing after it is enqueued."""
    cdef Py_ssize_t S = global_size.shape[0], K = kernels.shape[0], P = patch_args.shape[1]
    if dims.shape[0] != K or local.shape[0] != K or local.shape[1] != 3 or global_size.shape[1] != K \
            or global_size.shape[2] != 3 or patch_args.shape[0] != K or patch_values.shape[0] != S \
            or patch_values.shape[1] != K or patch_values.shape[2] != P:
        found = [dims.shape[0], (local.shape[0], local.shape[1]),
                 (global_size.shape[0], global_size.shape[1], global_size.shape[2]),
                 (patch_args.shape[0], patch_args.shape[1]),
                 (patch_values.shape[0], patch_values.shape[1], patch_values.shape[2])]
        raise ValueError(f"enqueue: for {S} steps of {K} launches with {P} patches, expected dims [{K}], local "
                         f"[{K}, 3], global_size [{S}, {K}, 3], patch_args [{K}, {P}], patch_values [{S}, {K}, {P}]; "
                         f"found {', '.join(map(str, found))}")
    cdef Py_ssize_t k, d, s, p
    for k in range(K):
        if not 1 <= dims[k] <= 3:
            raise ValueError(f"enqueue: launch {k} has {dims[k]} dimensions, expected 1 to 3")
        for d in range(3):
            if local[k, d] < 0:
                raise ValueError(f"enqueue: launch {k}'s local size {local[k, d]} is negative")
    cdef set_arg_f set_arg_call = <set_arg_f><void*>set_arg
    cdef enqueue_f enqueue_call = <enqueue_f><void*>enqueue_kernel
    cdef size_t g[3]
    cdef size_t l[3]
    cdef int32_t err = 0
    cdef bint skip
    cdef Py_ssize_t at_step = -1, at_launch = -1
    with nogil:
        for s in range(S):
            for k in range(K):
                skip = False
                for d in range(dims[k]):
                    if global_size[s, k, d] <= 0:
                        skip = True
                    g[d] = <size_t>global_size[s, k, d]
                    l[d] = <size_t>local[k, d]
                if skip:
                    continue
                for p in range(P):
                    if patch_args[k, p] < 0:
                        break
                    err = set_arg_call(<void*><uintptr_t>kernels[k], <uint32_t>patch_args[k, p], sizeof(int32_t),
                                       &patch_values[s, k, p])
                    if err != 0:
                        break
                if err == 0:
                    err = enqueue_call(<void*>queue, <void*><uintptr_t>kernels[k], <uint32_t>dims[k], NULL, g,
                                       l if local[k, 0] > 0 else NULL, 0, NULL, NULL)
                if err != 0:
                    at_step, at_launch = s, k
                    break
            if err != 0:
                break
    return err, at_step, at_launch
