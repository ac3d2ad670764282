"""Transformer encoder blocks built from lamina's layers, with PyTorch's structure and parameter
names, so a torch.nn.TransformerEncoder's state_dict maps onto them name for name."""
from __future__ import annotations

from typing import Optional

from .attention import MultiheadAttention
from .dense import Activation, Add, Dropout, Linear
from .normalization import LayerNorm

# PyTorch's activation names for the feed-forward block, as lamina's activations
FEED_FORWARD_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}


class TransformerEncoderLayer:
    """torch.nn.TransformerEncoderLayer on a sequence batch of [d_model] rows (or [T, d_model]
    per sample):
        norm_first=False:  x = norm1(x + sa(x));  x = norm2(x + ff(x))
        norm_first=True:   x = x + sa(norm1(x));  x = x + ff(norm2(x))
    with sa = dropout1(self_attn(·)) and ff = dropout2(linear2(dropout(act(linear1(·))))). Called on
    a value it adds its layers to that value's network, named '<name>.self_attn',
    '<name>.linear1', '<name>.norm1', … so their parameters carry PyTorch's names
    ('<name>.self_attn.in_proj_weight', '<name>.linear1.weight', …). Dropout on the attention
    weights themselves is not applied (lamina's attention kernel keeps no weights to drop)."""

    def __init__(self, d_model: int, nhead: int, dim_feedforward: int = 2048, dropout: float = 0.1,
                 activation: str = "relu", layer_norm_eps: float = 1e-5, norm_first: bool = False,
                 bias: bool = True, causal: bool = False, name: Optional[str] = None) -> None:
        if activation not in FEED_FORWARD_ACTIVATIONS:
            raise ValueError(f"TransformerEncoderLayer: activation must be one of "
                             f"{', '.join(FEED_FORWARD_ACTIVATIONS)}, found {activation!r}")
        self.d_model, self.nhead, self.dim_feedforward = int(d_model), int(nhead), int(dim_feedforward)
        self.dropout, self.activation, self.layer_norm_eps = float(dropout), activation, float(layer_norm_eps)
        self.norm_first, self.bias, self.causal, self.name = bool(norm_first), bool(bias), bool(causal), name

    def __call__(self, x):
        name = self.name or x.network.fresh_name("encoder_layer")
        d, p, eps, bias = self.d_model, self.dropout, self.layer_norm_eps, self.bias

        def layer(kind, local, *args, **kw):
            return kind(*args, name=f"{name}.{local}", **kw)

        norm1 = layer(LayerNorm, "norm1", d, eps=eps, bias=bias)
        norm2 = layer(LayerNorm, "norm2", d, eps=eps, bias=bias)

        def dropout(local, h):  # (none at all where p is 0: in training a dropout of 0 would copy)
            return layer(Dropout, local, p)(h) if p else h

        def attend(h):
            h = layer(MultiheadAttention, "self_attn", d, self.nhead, bias=bias, causal=self.causal)(h)
            return dropout("dropout1", h)

        def feed_forward(h):
            h = layer(Linear, "linear1", d, self.dim_feedforward, bias=bias)(h)
            h = layer(Activation, "activation", FEED_FORWARD_ACTIVATIONS[self.activation])(h)
            h = layer(Linear, "linear2", self.dim_feedforward, d, bias=bias)(dropout("dropout", h))
            return dropout("dropout2", h)

        if self.norm_first:
            x = layer(Add, "residual1")(x, attend(norm1(x)))
            return layer(Add, "residual2")(x, feed_forward(norm2(x)))
        x = norm1(layer(Add, "residual1")(x, attend(x)))
        return norm2(layer(Add, "residual2")(x, feed_forward(x)))


class TransformerEncoder:
    """torch.nn.TransformerEncoder: num_layers copies of an encoder layer's configuration (each
    with its own parameters, named '<name>.layers.<i>.…'), then an optional final LayerNorm
    ('<name>.norm', as PyTorch's `norm` argument; norm_eps None: none)."""

    def __init__(self, encoder_layer: TransformerEncoderLayer, num_layers: int, norm_eps: Optional[float] = None,
                 name: Optional[str] = None) -> None:
        if int(num_layers) < 1:
            raise ValueError(f"TransformerEncoder: num_layers must be at least 1, found {num_layers}")
        self.template, self.num_layers, self.norm_eps, self.name = encoder_layer, int(num_layers), norm_eps, name

    def __call__(self, x):
        name = self.name or x.network.fresh_name("encoder")
        t = self.template
        for i in range(self.num_layers):
            x = TransformerEncoderLayer(t.d_model, t.nhead, t.dim_feedforward, t.dropout, t.activation,
                                        t.layer_norm_eps, t.norm_first, t.bias, t.causal, name=f"{name}.layers.{i}")(x)
        if self.norm_eps is not None:
            x = LayerNorm(t.d_model, eps=self.norm_eps, bias=t.bias, name=f"{name}.norm")(x)
        return x
