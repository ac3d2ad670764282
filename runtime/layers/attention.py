"""Multi-head self-attention over packed sequences: each sequence attends within itself, so a
ragged batch needs neither padding nor a mask."""
from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np

from ..graph import Spec
from ..random import generator
from ..scheduler import GradTarget
from .base import Layer, constant, register, require_float, uniform
from .dense import affine, affine_backward


@register
class MultiheadAttention(Layer):
    """y = out_proj(attention(in_proj(x))), torch.nn.MultiheadAttention's self-attention with its
    parameter names and layouts: in_proj_weight [3E, E] and in_proj_bias [3E] (query, key, value
    in that order), out_proj.weight [E, E] and out_proj.bias [E]; E = embed_dim, split into
    num_heads heads of E / num_heads. Row i of a sequence attends to the rows j of the same
    sequence (j <= i when causal): softmax_j(q_i·k_j / sqrt(E / num_heads)) v_j.

    The input is a sequence batch of [E] rows, or [T, E] per sample (N sequences of T rows). The
    scores are never held as a [T, T] array (Backend.attention)."""

    kind = "multihead_attention"

    def __init__(self, embed_dim: int, num_heads: int, bias: bool = True, causal: bool = False,
                 name: Optional[str] = None) -> None:
        super().__init__(name)
        self.embed_dim, self.num_heads = int(embed_dim), int(num_heads)
        self.has_bias, self.causal = bool(bias), bool(causal)
        if self.embed_dim < 1 or self.num_heads < 1 or self.embed_dim % self.num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim must be a positive multiple of num_heads, found "
                             f"embed_dim={embed_dim}, num_heads={num_heads}")
        E, rng = self.embed_dim, generator()
        # PyTorch's initialisation: Xavier-uniform in_proj_weight, zero biases, out_proj as a Linear
        self.add_param("in_proj_weight", uniform(rng, math.sqrt(6 / (4 * E)), (3 * E, E)))
        self.add_param("out_proj.weight", uniform(rng, 1 / math.sqrt(E), (E, E)))
        if self.has_bias:
            self.add_param("in_proj_bias", constant(0.0, (3 * E,)))
            self.add_param("out_proj.bias", constant(0.0, (E,)))

    @property
    def head_dim(self):
        return self.embed_dim // self.num_heads

    def config(self):
        return {"embed_dim": self.embed_dim, "num_heads": self.num_heads, "bias": self.has_bias,
                "causal": self.causal}

    def product_weights(self):
        return ("in_proj_weight", "out_proj.weight")

    def output_spec(self, specs):
        x = specs[0]
        require_float(x, "input 0")
        expected = (self.embed_dim,) if x.sequence else (x.shape[0] if x.shape else 0, self.embed_dim)
        if x.shape != expected or (not x.sequence and x.shape[0] < 1):
            raise ValueError(f"input 0 must be a sequence batch of [{self.embed_dim}] rows or [T, {self.embed_dim}] "
                             f"per sample, found {x}")
        return x

    def _arrays(self, ctx):
        """The input as rows, the output as rows, the sequences' offsets, and the workspaces kept
        from forward for backward: qkv [rows, 3E], the attention's output [rows, E], lse."""
        x, E = ctx.inputs[0], self.embed_dim
        rows = x.size // E
        starts = ctx.starts if ctx.starts is not None else equal_lengths(x.shape[0], x.shape[1])
        return (x.reshape(rows, E), ctx.output.reshape(rows, E), starts, ctx.workspace("qkv", (rows, 3 * E)),
                ctx.workspace("attended", (rows, E)), ctx.workspace("lse", (rows, self.num_heads)))

    def _scale(self):
        return 1 / math.sqrt(self.head_dim)

    def forward(self, ctx):
        x, y, starts, qkv, attended, lse = self._arrays(ctx)
        bias = self.has_bias
        affine(self, ctx, x, "in_proj_weight", qkv, "in_proj_bias" if bias else None)
        ctx.be.attention(qkv, starts, self.num_heads, self._scale(), self.causal, attended, lse)
        affine(self, ctx, attended, "out_proj.weight", y, "out_proj.bias" if bias else None)

    def backward(self, ctx):
        x, out, starts, qkv, attended, lse = self._arrays(ctx)
        dy = ctx.grad_output.reshape(out.shape)
        be, bias = ctx.be, self.has_bias
        d_attended = ctx.workspace("d_attended", attended.shape)
        affine_backward(self, ctx, dy, attended, "out_proj.weight", "out_proj.bias" if bias else None,
                        GradTarget(d_attended, 0.0))
        dqkv = ctx.workspace("dqkv", qkv.shape)
        be.attention_backward(qkv, attended, lse, d_attended, starts, self.num_heads, self._scale(), self.causal,
                              dqkv)
        dx = ctx.input_grad(0)
        affine_backward(self, ctx, dqkv, x, "in_proj_weight", "in_proj_bias" if bias else None,
                        None if dx is None else GradTarget(dx.array.reshape(x.shape), dx.beta))


@functools.lru_cache(maxsize=64)
def equal_lengths(n, t):
    """The offsets of n sequences of t rows each (int32, read-only: one array per size, so a
    device backend copies it once)."""
    starts = np.arange(n + 1, dtype=np.int32) * np.int32(t)
    starts.flags.writeable = False
    return starts
