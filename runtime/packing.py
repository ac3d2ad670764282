"""Packed weights as caches: MKL packed GEMM bakes a weight's values (and alpha) into a buffer, so
a pack is valid only while the parameter keeps the values it was packed from. PackedWeight compares
the parameter's version (and the thread count, which MKL wants equal at pack and compute time)
and repacks when either moved. Paddle's packed recurrent layer repacked only after backward, so
inference right after loading used stale weights; this cannot happen here.
"""
from .threads import get_num_threads


class PackedWeight:
    """alpha * op(param) packed for `backend.packed_gemm`, rebuilt whenever it would be stale."""

    def __init__(self, backend, param, trans=False, alpha=1.0):
        self.backend, self.param, self.trans, self.alpha = backend, param, trans, alpha
        self._packed = None
        self._key = None
        self.repacks = 0  # how many times it was (re)built; tests read it

    def get(self, rows):
        """The pack, valid for products with up to `rows` rows on the left."""
        key = (self.param.version, id(self.param.buffer), get_num_threads())
        if self._packed is None or key != self._key or rows > self._packed.max_rows:
            max_rows = max(rows, self._packed.max_rows if self._packed is not None else 0)
            self._packed = self.backend.pack(self.param.buffer, self.trans, self.alpha, max_rows)
            self._key = key
            self.repacks += 1
        return self._packed
