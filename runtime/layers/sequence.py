"""Layers for sequence batches: embedding lookup, pooling to one row per sequence, and softmax
over each sequence's steps."""
from __future__ import annotations

import math
from typing import Optional

import numpy as np

from ..backends.base import POOL_MODES
from ..errors import InputError
from ..graph import Spec
from ..random import generator
from .base import Init, Layer, check_ids, register, require_float


@register
class Embedding(Layer):
    """y[i] = W[ids[i]]; ids int32 (one per row, in a sequence batch or not), W [num, dim] as
    torch.nn.Embedding (initialised N(0, 1)). The weight gradient is sparse: only the rows used
    are written, and SGD and AdaGrad update only those rows (where that is exact)."""

    kind = "embedding"

    def __init__(self, num_embeddings: int, embedding_dim: int, name: Optional[str] = None) -> None:
        super().__init__(name)
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        if min(self.num_embeddings, self.embedding_dim) < 1:
            raise ValueError(f"Embedding: sizes must be at least 1, found {num_embeddings}, {embedding_dim}")
        self.add_param("weight", Init((self.num_embeddings, self.embedding_dim),
                                      lambda shape: generator().standard_normal(shape))).row_gradients = True

    @property
    def weight(self):
        return self.params["weight"]

    def product_weights(self):
        """The table: its rows are stored in the network's precision (int8 per row, the rows a
        lookup gathers), and gathered as those values."""
        return ("weight",)

    def config(self):
        return {"num_embeddings": self.num_embeddings, "embedding_dim": self.embedding_dim}

    def output_spec(self, specs):
        ids = specs[0]
        if ids.kind != "int32" or ids.shape != ():
            raise ValueError(f"input 0 must be one int32 id per row, found {ids}")
        return Spec((self.embedding_dim,), sequence=ids.sequence)

    def grad_slots(self, n_inputs):
        return ()

    def forward(self, ctx):
        ids = ctx.host_input(0)  # the host snapshot of the ids: checked here, read by both passes
        check_ids(ctx, ids, self.num_embeddings, "ids")
        ctx.be.gather_rows(self.weight.buffer, ids, ctx.output)

    def backward(self, ctx):
        ids = ctx.host_input(0)
        grad = ctx.sparse_param_grad("weight", ids)
        if grad is not None:
            ctx.be.scatter_add_rows(ctx.grad_output, ids, grad)


@register
class PositionalEmbedding(Layer):
    """y[i] = x[i] + W[position of row i within its sequence] (a learned position embedding, as
    BERT's): x a sequence batch of [embedding_dim] rows, or [T, embedding_dim] per sample
    (positions 0 .. T-1); W [num_positions, embedding_dim], initialised N(0, 1). Its gradient is
    sparse, as Embedding's."""

    kind = "positional_embedding"

    def __init__(self, num_positions: int, embedding_dim: int, name: Optional[str] = None) -> None:
        super().__init__(name)
        self.num_positions, self.embedding_dim = int(num_positions), int(embedding_dim)
        if min(self.num_positions, self.embedding_dim) < 1:
            raise ValueError(f"PositionalEmbedding: sizes must be at least 1, found {num_positions}, {embedding_dim}")
        self.add_param("weight", Init((self.num_positions, self.embedding_dim),
                                      lambda shape: generator().standard_normal(shape))).row_gradients = True

    def config(self):
        return {"num_positions": self.num_positions, "embedding_dim": self.embedding_dim}

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if x.shape[-1:] != (self.embedding_dim,) or len(x.shape) != (1 if x.sequence else 2):
            raise ValueError(f"input 0 must be a sequence batch of [{self.embedding_dim}] rows or "
                             f"[T, {self.embedding_dim}] per sample, found {x}")
        if not x.sequence and x.shape[0] > self.num_positions:
            raise ValueError(f"input 0 has {x.shape[0]} positions, more than num_positions={self.num_positions}")
        return x

    def _positions(self, ctx):
        """Each row's position in its sequence (int32, host), checked against num_positions."""
        x = ctx.inputs[0]
        if ctx.starts is None:
            return np.tile(np.arange(x.shape[1], dtype=np.int32), x.shape[0])
        starts = ctx.starts
        positions = np.arange(starts[-1], dtype=np.int32) - np.repeat(starts[:-1], np.diff(starts))
        if len(positions) and positions.max() >= self.num_positions:
            longest = int(np.diff(starts).max())
            raise InputError(f"{ctx.node.describe()}: a sequence of {longest} rows is longer than "
                             f"num_positions={self.num_positions}")
        return positions

    def forward(self, ctx):
        rows = ctx.output.reshape(-1, self.embedding_dim)
        ctx.be.gather_rows(self.params["weight"].buffer, self._positions(ctx), rows)
        ctx.be.axpby(1.0, ctx.inputs[0].reshape(rows.shape), 1.0, rows)

    def backward(self, ctx):
        dy = ctx.grad_output.reshape(-1, self.embedding_dim)
        dx = ctx.input_grad(0)
        if dx is not None:
            ctx.be.axpby(1.0, dy, dx.beta, dx.array.reshape(dy.shape))
        positions = self._positions(ctx)
        grad = ctx.sparse_param_grad("weight", positions)
        if grad is not None:
            ctx.be.scatter_add_rows(dy, positions, grad)


@register
class SequencePool(Layer):
    """One row per sequence: the last, first, average, sum or max of its rows."""

    kind = "sequence_pool"

    def __init__(self, mode: str = "last", name: Optional[str] = None) -> None:
        super().__init__(name)
        if mode not in POOL_MODES:
            raise ValueError(f"SequencePool: mode must be one of {', '.join(POOL_MODES)}, found {mode!r}")
        self.mode = mode

    def config(self):
        return {"mode": self.mode}

    def output_spec(self, specs):
        require_float(specs[0], "input 0")
        if not specs[0].sequence:
            raise ValueError(f"input 0 must be a sequence batch, found {specs[0]}")
        return Spec(specs[0].shape)

    def _argmax(self, ctx):
        out = ctx.output
        return ctx.workspace("argmax", (out.shape[0], int(math.prod(out.shape[1:]))), np.int32)

    def forward(self, ctx):
        ctx.be.sequence_pool(self.mode, ctx.inputs[0], ctx.starts, ctx.output, self._argmax(ctx))

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is not None:
            ctx.be.sequence_pool_backward(self.mode, ctx.grad_output, ctx.starts, self._argmax(ctx),
                                          dx.array, dx.beta)


@register
class SequenceSoftmax(Layer):
    """Softmax over the steps of each sequence, for one value per step ([] or [1] per row)."""

    kind = "sequence_softmax"

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        if not x.sequence or x.shape not in ((), (1,)):
            raise ValueError(f"input 0 must be a sequence batch of one value per step, found {x}")
        return x

    def forward(self, ctx):
        ctx.be.sequence_softmax(ctx.inputs[0], ctx.starts, ctx.output)

    def backward(self, ctx):
        dx = ctx.input_grad(0)
        if dx is not None:
            ctx.be.sequence_softmax_backward(ctx.output, ctx.grad_output, ctx.starts, dx.array, dx.beta)
