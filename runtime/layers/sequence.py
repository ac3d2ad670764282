"""Layers for sequence batches: embedding lookup, pooling to one row per sequence, and softmax
over each sequence's steps."""
from __future__ import annotations

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
        return ctx.workspace("argmax", (out.shape[0], int(np.prod(out.shape[1:]))), np.int32)

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
