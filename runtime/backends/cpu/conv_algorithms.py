"""The CPU backend's convolution algorithms, and the rule that picks one per layer and shape:

- winograd (cpu/winograd.py): F(2, 3) along each axis for stride-1 kernels of 3, forward and
  input gradient;
- direct (cpu/direct.py): no column matrix, unit width stride; forward, input gradient (all
  strides 1) and weight gradient (kernel width up to 3); and 'direct, width phases' for a width
  stride s > 1 (a candidate for 'measure': the rule prefers columns, measured faster);
- depthwise (cpu/depthwise.py): one group per input channel, forward and both gradients, a
  compiled task per (sample, channel) plane;
- depth taps (cpu/depth_taps.py): 3-D with depth stride 1, kd GEMMs over a 2-D column matrix;
- depth to space (here): a transposed convolution whose kernel equals its stride writes each
  output once from its column matrix instead of adding it into a zeroed output;
- sub-pixel (cpu/phases.py): a strided transposed convolution as one stride-1 direct
  convolution per output phase, forward;
- pointwise (cpu/pointwise.py): kernel 1, stride 1, no padding, one group: panel tiles over the
  input itself (by panels of positions, or by tiles of positions against W's packed panels),
  each stored with its bias and activation;
- columns: vol2col + GEMM (lamina.backends.columns), everything else; with one group each
  block's product runs on the pointwise kernels, storing the bias and activation
  (pointwise.columns_forward); for a grouped pointwise convolution the GEMMs read the input
  itself.

The Winograd and direct kernels add the bias and apply a ReLU as they store each output (no pass
over the output of their own); other algorithms and activations take those passes after.

In a bfloat16 run the algorithms made of GEMMs (columns, pointwise, depth taps, depth to space,
and the backward's column paths) multiply both operands rounded to bfloat16 (columns.products:
Backend.gemm_in); the pointwise and column forwards do where their products are at least
pointwise.BF16_MIN_DEPTH deep (on W's bfloat16 panels, packed once, for samples of few
positions where the CPU has AVX512-BF16: pointwise.bfloat16_forward) and run as in float32 where
they are shallower (bfloat16 measured slower there). Winograd and the direct, depthwise and
sub-pixel kernels multiply float32 activations by the weights' values (those of a bfloat16
network rounded to bfloat16), as float32 networks do.
"""
import logging
import math
import time

from .compiled import _kernels
from .. import columns
from ...precision import product_precision
from ...threads import SettingError, get_num_threads
from . import depth_taps, depthwise, direct, phases, pointwise, winograd

_log = logging.getLogger("lamina.conv")

ALGORITHMS = ("depthwise", "pointwise", "winograd", "direct", "direct, width phases", "depth taps", "depth to space",
              "sub-pixel", "columns")
_setting = {"mode": "rule"}
_measured: dict = {}  # (geometry, batch, dtype, threads) -> the fastest forward measured
_ruled: dict = {}  # (geometry, batch, mode) -> the rule's forward (a run asks once per layer)
RULED_MAX = 4096  # entries kept (inputs of ever new shapes start it again instead of growing it)


def set_conv_algorithm(mode):
    """How the CPU picks a convolution's forward algorithm, process-wide: 'rule' (the default:
    by the shape, as forward_algorithm says), 'measure' (time every algorithm that applies once
    per layer geometry, input shape and thread count, then keep the fastest, like cuDNN's
    benchmark mode; logged at DEBUG on 'lamina.conv'), or one of ALGORITHMS (that one wherever
    it applies, the rule elsewhere)."""
    if mode not in ("rule", "measure") + ALGORITHMS:
        raise SettingError(f"set_conv_algorithm: expected 'rule', 'measure' or one of {', '.join(ALGORITHMS)}, "
                           f"found {mode!r}")
    _setting["mode"] = mode
    _measured.clear()
    _ruled.clear()


def get_conv_algorithm():
    return _setting["mode"]


def candidates(geom):
    """The forward algorithms that apply to a convolution."""
    if geom.transposed:
        return (["depth to space"] if _no_overlap(geom) else []) + (["sub-pixel"] if phases.applies(geom) else []) \
            + ["columns"]
    found = [name for name, applies in (("depthwise", depthwise.applies), ("pointwise", pointwise.applies),
                                        ("winograd", winograd.applies),
                                        ("direct", direct.applies),
                                        ("direct, width phases", direct.width_phases_apply),
                                        ("depth taps", depth_taps.applies)) if applies(geom)]
    return found + ["columns"]


# The rule, from `python -m bench conv` on the bench's shapes: the depthwise kernels wherever a
# convolution has one group per input channel (the column path runs a GEMM per channel);
# Winograd wherever it applies with at least WINOGRAD_MIN_CHANNELS channels in and out (fewer,
# and its vectors of channels are mostly padding: a single input channel is padded to a vector
# of eight); then the direct kernel, depth taps, depth to space, columns. A width stride runs as
# columns (the width phases lose to one large GEMM); a transposed kernel equal to its stride as
# depth to space. A strided transposed convolution runs as sub-pixel phases when it has groups,
# whose GEMMs are small, else as columns, whose one GEMM runs at the sgemm peak where the direct
# kernel does not.
WINOGRAD_MIN_CHANNELS = 8
# On at least WINOGRAD_MIN_CHANNELS channels in and out, the direct kernel runs only where the
# batch has at least this many output positions (samples x the output grid): below it columns
# run faster. Winograd has no such floor: a batch smaller than the team shares each sample's
# tiles between threads (ResNet-18's 3x3 layers at batch 1, ms, Winograd / direct / columns,
# 1 thread: 56x56 2.15 / 4.11 / 3.54, 28x28 1.56 / 4.20 / 3.24, 14x14 1.51 / 4.49 / 3.34, 7x7
# 2.07 / 9.29 / 3.48; 2 threads: 56x56 1.48 / 4.12 / 4.10, 7x7 2.08 / 15.2 / 3.00; batch 32,
# 2 threads: 56x56 28.3 / 60.4 / 38.2, 7x7 36.0 / 112 / 36.6)
DIRECT_MIN_POSITIONS = 8192
# A one-group pointwise convolution runs on the pointwise kernels (pointwise.py picks one of its
# two by the sample's positions and depth), faster than columns at every MobileNet-V2 layer.
_RULE = ("depthwise", "winograd", "direct", "depth taps", "depth to space", "sub-pixel", "columns")


def _pick(geom, found, positions=None):
    """Of the algorithms that apply, the one forced, else the rule's first; `positions` (the
    batch's output positions, where known) rules out the direct kernel on a small batch."""
    if _setting["mode"] in found:
        return _setting["mode"]
    if geom.pointwise:
        return "pointwise" if "pointwise" in found else "columns"
    skip = set()
    if min(geom.in_channels, geom.out_channels) < WINOGRAD_MIN_CHANNELS:
        skip.add("winograd")
    elif positions is not None and positions < DIRECT_MIN_POSITIONS:
        skip.add("direct")
    if geom.groups == 1:
        skip.add("sub-pixel")
    return next((name for name in _RULE if name in found and name not in skip), None)


def forward_algorithm(geom, batch=None):
    """The algorithm the rule (or a forced setting) runs a convolution's forward with, for a
    batch of `batch` samples (None: any)."""
    positions = None if batch is None else batch * math.prod(geom.out_size)
    return _pick(geom, candidates(geom), positions)


def _input_grad_algorithm(geom):
    """'winograd' or 'direct' where the input gradient runs as a stride-1 convolution of dy with
    the flipped kernel, else None (the backward's column or depth-tap path computes it)."""
    return _pick(geom, [name for name, applies in (("winograd", winograd.applies(geom)),
                                                   ("direct", direct.flipped_padding(geom) is not None)) if applies])


def algorithms(geom):
    """{'forward', 'input grad', 'weight grad'}: the algorithm of each (the input gradient
    assumed wanted); 'measured' where the forward is timed per shape."""
    forward_name = "measured" if _setting["mode"] == "measure" else forward_algorithm(geom)
    if geom.pointwise:  # backward always runs as the GEMMs on the input (backward below)
        return {"forward": forward_name, "input grad": "columns", "weight grad": "columns"}
    if depthwise.applies(geom):
        return {"forward": forward_name, "input grad": "depthwise", "weight grad": "depthwise"}
    taps = "depth taps" if depth_taps.applies(geom) else "columns"
    return {"forward": forward_name, "input grad": _input_grad_algorithm(geom) or taps,
            "weight grad": "direct" if direct.weight_grad_applies(geom) else taps}


def forward(geom, weight, ctx, bias=None, activation=None):
    """A convolution's forward, plain or transposed: y = act(conv(x) + bias) (as
    Backend.conv_forward)."""
    name = _choose_forward(geom, weight, ctx)
    if name in ("pointwise", "columns") and product_precision(ctx.precision) == "bfloat16":
        if pointwise.bfloat16_forward(geom, weight, ctx, bias, activation):
            return
        ctx = columns.Replaced(ctx, precision="float32")  # (too shallow: float32 products)
    kind = "linear" if activation is None else activation[0]
    if name in _STORES_EPILOGUE:  # the bias as it stores, and the activation where it can
        stored = kind in _STORES_EPILOGUE[name]
        cap = {"cap": activation[1]} if stored and kind == "bounded_relu" else {}
        _FORWARD[name](geom, weight, ctx, bias, stored and kind != "linear", **cap)
        if not stored:
            ctx.be.activate_in_place(activation, ctx.output)
        return
    _FORWARD[name](geom, weight, ctx)
    columns.finish(ctx.be, ctx.output, bias, activation)


def forward_pooled(geom, weight, ctx, bias, activation, pool):
    """A convolution's forward followed by a max pool (Backend.conv_forward's pool) in one kernel,
    where the rule runs Winograd or the direct kernel and the pool has kernel = stride 2 along
    height and width, and along depth 1 or 2 (Winograd: 2 exactly where its tiles are 3-D), no
    padding, sizes rounded down: the kernel stores each window's maximum and nothing else (the
    pool's input is never written). True if it ran; else the caller runs the convolution and the
    pool."""
    algorithm = forward_algorithm(geom, ctx.inputs[0].shape[0])
    if (_setting["mode"] == "measure" or algorithm not in ("winograd", "direct")
            or (activation is not None and activation[0] not in ("relu", "linear"))):
        return False
    window, stride, padding = pool
    depths = ((2,) if winograd.volumetric(geom) else (1,)) if algorithm == "winograd" else (1, 2)
    if window != stride or window[1:] != (2, 2) or window[0] not in depths or max(padding) > 0:
        return False
    full = ctx.unpooled_shape()[2:]
    full = (1,) * (3 - len(full)) + full
    if columns.as_volume(ctx.output[0]).shape[1:] != tuple(n // t for n, t in zip(full, window)):
        return False
    relu = activation is not None and activation[0] == "relu"
    if algorithm == "winograd":
        winograd.forward(geom, weight, ctx, bias, relu, pool=True)
    else:
        direct.forward(geom, weight, ctx, bias, relu, pool_depth=window[0])
    return True


def _choose_forward(geom, weight, ctx):
    x = ctx.inputs[0]
    if _setting["mode"] != "measure":
        key = (geom, x.shape[0], _setting["mode"])
        choice = _ruled.get(key)
        if choice is None:
            if len(_ruled) >= RULED_MAX:
                _ruled.clear()
            choice = _ruled[key] = forward_algorithm(geom, x.shape[0])
        return choice
    key = (geom, x.shape[0], x.dtype.str, get_num_threads())
    choice = _measured.get(key)
    if choice is None:
        times = {}
        for name in candidates(geom):
            best = math.inf
            for _ in range(2):  # the first call also sizes the workspaces
                start = time.perf_counter()
                _FORWARD[name](geom, weight, ctx)
                best = min(best, time.perf_counter() - start)
            times[name] = best
        choice = _measured[key] = min(times, key=times.get)
        _log.debug("%s on %s: %s (%s)", geom, x.shape, choice,
                   ", ".join(f"{k} {1e3 * v:.2f} ms" for k, v in times.items()))
    return choice


def backward(geom, weight, ctx):
    """A plain convolution's weight and input gradients."""
    if geom.pointwise:
        return columns.backward(geom, weight, ctx, ctx.input_grad(0))
    if depthwise.applies(geom):
        return depthwise.backward(geom, weight, ctx)
    if direct.weight_grad_runs(geom, weight, ctx):
        return direct.backward(geom, weight, ctx, _input_grad)
    if depth_taps.applies(geom):
        return depth_taps.backward(geom, weight, ctx, _input_grad)
    columns.backward(geom, weight, ctx, _input_grad(geom, weight, ctx))


def _input_grad(geom, weight, ctx):
    """The input-gradient target the column paths should fill: None when the gradient is not
    wanted or was computed here (Winograd or the direct kernel on dy, flipped kernel)."""
    dx, algorithm = ctx.input_grad(0), _input_grad_algorithm(geom)
    if dx is None or algorithm is None:
        return dx
    flipped = direct.flipped_padding(geom)
    if algorithm == "winograd":
        winograd.run(geom, weight, ctx, "input grad", ctx.grad_output, dx.array, flipped, dx.beta)
    else:
        dilation = geom.windows[3]
        direct.run(geom, weight, ctx, "input grad", ctx.grad_output, dx.array, flipped, (1, 1, 1), dilation, dx.beta)
    return None


def _no_overlap(geom):
    """A transposed convolution whose windows do not overlap: kernel = stride on every axis, no
    padding, dilation or output padding (a U-Net's up-convolution, kernel 2, stride 2)."""
    return (geom.transposed and geom.kernel_size == geom.stride and max(geom.padding + geom.padding_end) == 0
            and max(geom.dilation) == 1 and max(geom.output_padding) == 0)


def _forward_depth_to_space(geom, weight, ctx, bias=None, relu=False):
    """One GEMM per block of input positions into the column matrix, whose rows then land in the
    output once each (depth_to_space) with the bias and ReLU, instead of being added into a zeroed
    output that a bias pass then reads and writes again."""
    columns.transposed_forward(geom, weight, ctx, place=lambda col, y, geometry, rows: _kernels.depth_to_space(
        col, y, *geometry[1], *rows, bias, relu))


# the algorithms whose kernels add the bias and apply an activation as they store, and the
# activations each applies: forward(geom, weight, ctx, bias, relu) (the depthwise kernel's
# bounded ReLU is its relu with cap=slope)
_STORES_EPILOGUE = {"depthwise": ("linear", "relu", "bounded_relu"), "pointwise": ("linear", "relu", "bounded_relu"),
                    "columns": ("linear", "relu", "bounded_relu"), "winograd": ("linear", "relu"),
                    "direct": ("linear", "relu"), "depth to space": ("linear", "relu")}
_FORWARD = {"depthwise": depthwise.forward, "pointwise": pointwise.forward, "winograd": winograd.forward,
            "direct": direct.forward,
            "direct, width phases": direct.forward_width_phases, "depth taps": depth_taps.forward,
            "depth to space": _forward_depth_to_space, "sub-pixel": phases.forward, "columns": pointwise.columns_forward}
