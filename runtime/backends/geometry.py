"""ConvGeometry: everything a backend reads of a convolution's shape, one frozen value that the
layer builds once per input size and hands to the backend with its weight (Backend.conv_forward,
conv_backward, conv_algorithms); algorithms choose and run by it alone.

Per-axis tuples are the layer's own (nd long, PyTorch's meaning). vol2col and col2vol take the
3-D form, `windows`: (kernel, stride, padding, dilation, window grid) over depth, height and width,
a 2-D convolution being the 3-D one with depth 1 (kernel 1, stride 1, padding 0). The window grid
is the output grid of a convolution and the input grid of a transposed one (whose windows are
its input positions).
"""
from __future__ import annotations

from dataclasses import dataclass, field

Ints = tuple[int, ...]


@dataclass(frozen=True)
class ConvGeometry:
    nd: int  # 2 or 3
    transposed: bool
    in_channels: int
    out_channels: int
    groups: int
    kernel_size: Ints
    stride: Ints
    padding: Ints  # before each axis
    padding_end: Ints  # after each axis
    dilation: Ints
    output_padding: Ints
    in_size: Ints  # the input's spatial grid
    out_size: Ints  # the output's spatial grid
    windows: tuple = field(init=False, compare=False, repr=False)

    def __post_init__(self):
        lead, zero = (1,) * (3 - self.nd), (0,) * (3 - self.nd)
        grid = self.in_size if self.transposed else self.out_size
        object.__setattr__(self, "windows", (lead + self.kernel_size, lead + self.stride, zero + self.padding,
                                             lead + self.dilation, lead + tuple(grid)))

    @property
    def symmetric(self) -> bool:
        """Whether every axis is padded alike on both sides (the direct and depth-tap kernels take
        one padding per axis; vol2col and col2vol read the grid they are given)."""
        return self.padding == self.padding_end

    @property
    def pointwise(self) -> bool:
        """A plain convolution whose column matrix is its input: kernel 1, stride 1, no padding on
        every axis (vol2col would be a copy)."""
        return (not self.transposed and max(self.kernel_size + self.stride) == 1
                and max(self.padding + self.padding_end) == 0)


def output_sizes(transposed, sizes, kernel, stride, padding, padding_end, dilation, output_padding):
    """The output grid of a convolution (PyTorch's formulas) for an input grid `sizes`."""
    if transposed:
        return tuple((n - 1) * s - p - q + d * (k - 1) + op + 1 for n, k, s, p, q, d, op in
                     zip(sizes, kernel, stride, padding, padding_end, dilation, output_padding))
    return tuple((n + p + q - d * (k - 1) - 1) // s + 1 for n, k, s, p, q, d in
                 zip(sizes, kernel, stride, padding, padding_end, dilation))
