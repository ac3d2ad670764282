"""The compiled module _opencl_steps (Cython, pyx/_opencl_steps.pyx): enqueues a recorded plan's
steps (lamina.backends.opencl_plan)."""
import numpy as np


def set_constants(set_arg: int, kernels: np.ndarray, args: np.ndarray, sizes: np.ndarray,
                  values: np.ndarray) -> tuple[int, int, int]: ...


def enqueue(set_arg: int, enqueue_kernel: int, queue: int, kernels: np.ndarray, dims: np.ndarray, local: np.ndarray,
            global_size: np.ndarray, patch_args: np.ndarray, patch_values: np.ndarray) -> tuple[int, int, int]: ...
