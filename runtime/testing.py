"""The gradient check every layer test uses.

Float64 central differences over every element of every float input and every trainable
parameter, compared with backward: |analytic - numeric| <= rtol * max(|analytic|, |numeric|, floor),
or below the resolution of the difference itself (100 ulp of the loss divided by the step).
The floor keeps tiny gradients from demanding impossible relative precision (Caffe and Paddle
do the same); rtol 1e-5 with step 1e-6 in float64 leaves about two orders of magnitude of margin
over the finite-difference error while a wrong sign, a missing term or a wrong factor fails by
orders of magnitude. A second backward without an update must double every parameter gradient
(accumulation) and leave input gradients unchanged (they are overwritten).

Dropout masks stay fixed across the evaluations: the network's generator is reset to the same
state before every forward.
"""
import copy

import numpy as np

from .errors import GradientCheckError
from .layers.costs import SquareError
from .sequence import Sequences


def add_probe_cost(net, value, seed=0):
    """Make `value` the subject of a gradient check: adds an input '<value>:probe' and a
    SquareError cost against it, so the loss depends on every element of `value`. Returns the
    probe input's name; feed it random data (see `probe_feed`)."""
    name = f"{value.name}:probe"
    target = net.input(name, value.spec.shape, sequence=value.spec.sequence)
    cost = SquareError()(value, target)
    net.outputs(**{f"{value.name}:cost": cost})
    return name


def probe_feed(net, name, batch, seed=0):
    """Random targets for a probe input: `batch` rows, or a Sequences with these offsets when
    `batch` is a Sequences (the probe of a sequence value)."""
    spec = net.values[name].spec
    rows = batch.total_steps if isinstance(batch, Sequences) else batch
    values = np.random.default_rng(seed).standard_normal((rows,) + spec.shape).astype(net.dtype)
    return Sequences(values, batch.starts) if isinstance(batch, Sequences) else values


def _loss(net, feeds, rng_state):
    net.rng.bit_generator.state = copy.deepcopy(rng_state)
    outs = net.forward(feeds, training=True)
    sched = net.scheduler
    plan = sched.current.plan
    return sum(float(np.sum(outs[o], dtype=np.float64)) / sched.current.rows(v)
               for o, v in net.output_values.items() if v in plan.costs)


def check_gradients(net, feeds, inputs=None, eps=1e-6, rtol=1e-5, floor=1e-3, max_points=None, seed=0):
    """Compare backward with central differences for the float inputs named in `inputs` (default:
    every float input fed) and every trainable parameter. The network must be float64. Returns
    the number of points checked; raises GradientCheckError naming the worst point."""
    if net.dtype != np.float64:
        raise ValueError(f"check_gradients needs a float64 network (net.astype('float64')), found {net.dtype}")
    explicit = inputs is not None
    if inputs is None:
        inputs = [n for n in feeds if net.values[n].spec.kind == "float" and not n.endswith(":probe")]
    before = {name: net.values[name].requires_grad for name in net.input_names}
    for name in net.input_names:
        net.values[name].requires_grad = name in inputs
    try:
        return _check(net, feeds, inputs, explicit, eps, rtol, floor, max_points, seed)
    finally:
        for name, flag in before.items():
            net.values[name].requires_grad = flag


def _check(net, feeds, inputs, explicit, eps, rtol, floor, max_points, seed):
    rng_state = copy.deepcopy(net.rng.bit_generator.state)
    if not explicit:  # leave out inputs no layer differentiates (row weights)
        _loss(net, feeds, rng_state)
        inputs = [n for n in inputs if n in net.scheduler.current.grads]
    params = [(n, p) for n, p in net.named_parameters() if not p.frozen]

    # analytic gradients, then a second backward that must accumulate
    net.zero_grad()
    _loss(net, feeds, rng_state)
    net.backward()
    analytic = {f"input {n}": np.array(net.grad(n)) for n in inputs}
    analytic.update({f"parameter {n}": np.array(p.dense_grad(net.backend)) for n, p in params})
    _loss(net, feeds, rng_state)
    net.backward()
    for n, p in params:
        first, second = analytic[f"parameter {n}"], p.dense_grad(net.backend)
        if not np.allclose(second, 2 * first, rtol=1e-12, atol=1e-12):
            raise GradientCheckError(f"parameter {n}: a second backward must double its gradient "
                                     f"(accumulate), max deviation {np.abs(second - 2 * first).max():.3g}")
    for n in inputs:
        if not np.allclose(net.grad(n), analytic[f"input {n}"], rtol=1e-12, atol=1e-12):
            raise GradientCheckError(f"input {n}: a second backward must overwrite its gradient, not add")
    net.zero_grad()

    # numeric gradients
    targets = [(f"input {n}", getattr(feeds[n], "values", feeds[n]), None) for n in inputs] + [(f"parameter {n}", p.buffer, p) for n, p in params]
    pick = np.random.default_rng(seed)
    checked, worst = 0, (0.0, None)
    for label, array, param in targets:
        flat = array.reshape(-1)
        points = range(flat.size)
        if max_points is not None and flat.size > max_points:
            points = pick.choice(flat.size, max_points, replace=False)
        grad = analytic[label].reshape(-1)
        for i in points:
            old = flat[i]
            flat[i] = old + eps
            if param is not None:
                param.changed()
            up = _loss(net, feeds, rng_state)
            flat[i] = old - eps
            if param is not None:
                param.changed()
            down = _loss(net, feeds, rng_state)
            flat[i] = old
            if param is not None:
                param.changed()
            numeric = (up - down) / (2 * eps)
            # rounding in the loss itself bounds what a difference can resolve: ignore gaps below it
            noise = 100 * np.finfo(np.float64).eps * max(abs(up), abs(down), 1.0) / eps
            gap = abs(grad[i] - numeric)
            err = 0.0 if gap <= noise else gap / max(abs(grad[i]), abs(numeric), floor)
            if err > worst[0]:
                worst = (err, (label, np.unravel_index(i, array.shape), grad[i], numeric))
            checked += 1
    if worst[0] > rtol:
        label, index, a, n = worst[1]
        raise GradientCheckError(f"{label} at {tuple(int(j) for j in index)}: analytic {a:.8g}, numeric {n:.8g}, "
                                 f"relative error {worst[0]:.3g} > {rtol}")
    return checked


def core_only(backend_class, name=None):
    """`backend_class` stripped to the core kernels (lamina.backends.base.CORE_KERNELS): a
    subclass of Backend with that class's core methods and its private helpers, every other
    operation Backend's composed one. A backend author runs the conformance tests and every
    layer on it to see that the core set is all a backend needs."""
    from .backends.base import CORE_KERNELS, Backend
    namespace = {}
    for klass in reversed(backend_class.__mro__):
        if klass is object or issubclass(Backend, klass):
            continue
        for attr, value in vars(klass).items():
            private = attr.startswith("_") and not attr.startswith("__") and attr not in vars(Backend)
            if attr in CORE_KERNELS or private:
                namespace[attr] = value
    namespace.update(name=name or f"{backend_class.name}-core", host_arrays=backend_class.host_arrays,
                     __module__=__name__)
    if "__init__" in vars(backend_class):
        namespace["__init__"] = backend_class.__init__
    return type(f"CoreOnly{backend_class.__name__}", (Backend,), namespace)
