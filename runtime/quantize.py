"""int8 dynamic quantization of a network for inference (lamina.precision)."""
from __future__ import annotations

from .graph import Network


def quantize(net: Network) -> Network:
    """Make `net` multiply by its weights in int8 at inference (dynamic quantization): each product
    weight of Linear and the recurrent layers becomes int8 per output channel with its scale, and
    each row of the activations is quantized to u8 with a zero point when the product runs; the
    network is changed in place and returned. A model file keeps the int8 weights and scales."""
    return net.set_precision("int8")
