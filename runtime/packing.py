"""Packed weights as caches: MKL packed GEMM bakes a weight's values (and alpha) into a buffer, so
a pack is valid only while the parameter keeps the values it was packed from, for the backend
(and BLAS provider) that made it. PackedWeight keys the pack on everything it depends on: the
parameter's version and buffer, the backend object and its provider, and the thread count (which
MKL wants equal at pack and compute time), and repacks when any of them moved. Paddle's packed
recurrent layer repacked only after backward, so inference right after loading used stale
weights; this cannot happen here. Threads sharing a network share its packs: `get` builds under
a lock, and a caller keeps the pack it was handed alive for as long as it computes with it.
"""
import threading

from .threads import get_num_threads


class PackedWeight:
    """alpha * op(param) packed for `backend.packed_gemm`, rebuilt whenever it would be stale."""

    def __init__(self, param, trans=False, alpha=1.0, precision="float32", method="pack"):
        self.param, self.trans, self.alpha, self.precision = param, trans, alpha, precision
        # the backend's packing method: pack, pack_panels (the CPU's own panels), or pack_reduced (a
        # float32 pack of the values in a reduced precision)
        self.method = method
        self._packed = None
        self._key = None
        self._lock = threading.Lock()
        self.repacks = 0  # how many times it was (re)built; tests read it

    def get(self, backend, rows):
        """The pack for `backend`, valid for products with up to `rows` rows on the left. A
        parameter of more than two axes (a convolution's weight [out, in, k...]) packs as the
        matrix [out, in·k...]."""
        buffer = self.param.buffer
        key = (self.param.version, id(buffer), id(backend), getattr(backend, "blas_name", None),
               get_num_threads())
        if buffer.ndim > 2:
            buffer = buffer.reshape(buffer.shape[0], -1)
        with self._lock:
            packed = self._packed
            if packed is None or key != self._key or rows > packed.max_rows:
                max_rows = max(rows, packed.max_rows if packed is not None and key == self._key else 0)
                packed = getattr(backend, self.method)(buffer, self.trans, self.alpha, max_rows, self.precision)
                self._packed, self._key = packed, key
                self.repacks += 1
        return packed
