"""Optimizers and learning-rate schedules.

An optimizer updates one parameter at a time, when the scheduler reports that the parameter's
gradient is complete (its last user finished backward), so updates overlap with the rest of
backward. Each update is one fused kernel of the backend. State (moments, step counts) lives in
`param.state`, beside the parameter, so it can be saved and resumed.

Global-norm clipping needs every gradient before any update; with `clip_norm` set, updates are
therefore deferred to `end_step`, which computes the norm, scales and applies them all. So are
they on a backend whose reads wait for its device's queue (`Backend.reads_wait`: OpenCL): there,
checking each gradient as it completes would drain the queue once per parameter, and
`end_step` checks them all with one read instead (`Backend.sums_of_squares`).

Numbers that are not numbers (`nonfinite`): a step whose loss or any gradient holds NaN or
infinity must not reach the weights (one bad sample would otherwise make every weight NaN). With
"skip" (the default, as PyTorch's GradScaler does) such a step is skipped and counted in
`skipped_steps`; with "raise" it raises FloatingPointError naming what was not finite; "apply"
updates regardless. The loss is checked before backward starts, so a non-finite loss skips the
whole step. A gradient is checked just before its own update: when one is non-finite although
the loss was finite, the updates still to come in that step are skipped, while those already
made (from finite gradients) stay; with clip_norm, and where updates are deferred for the device,
every gradient is checked before any update.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import numpy as np


_default_backend = None


def _cpu():
    """The backend of parameters that hold host arrays (the CPU's), made when first needed."""
    global _default_backend
    if _default_backend is None:
        from .backends import get_backend
        _default_backend = get_backend("cpu")
    return _default_backend


# ---------------------------------------------------------------------------- schedules

class Constant:
    """factor(step) = 1."""

    def __call__(self, step):
        return 1.0


class StepDecay:
    """factor(step) = gamma ** (step // step_size)."""

    def __init__(self, step_size: int, gamma: float = 0.1) -> None:
        if step_size < 1:
            raise ValueError(f"StepDecay: step_size must be at least 1, found {step_size}")
        self.step_size, self.gamma = int(step_size), float(gamma)

    def __call__(self, step):
        return self.gamma ** (step // self.step_size)


class CosineWarmup:
    """Linear warm-up from 0 over `warmup` steps, then cosine decay to `min_factor` at `total`."""

    def __init__(self, warmup: int, total: int, min_factor: float = 0.0) -> None:
        if not 0 <= warmup < total:
            raise ValueError(f"CosineWarmup: expected 0 <= warmup < total, found warmup={warmup}, total={total}")
        self.warmup, self.total, self.min_factor = int(warmup), int(total), float(min_factor)

    def __call__(self, step):
        if step < self.warmup:
            return (step + 1) / (self.warmup + 1)
        progress = min(1.0, (step - self.warmup) / (self.total - self.warmup))
        return self.min_factor + (1 - self.min_factor) * 0.5 * (1 + math.cos(math.pi * progress))


# ---------------------------------------------------------------------------- optimizers

def hyper(where, name, value, low=None, high=None, low_open=False, high_open=True):
    """A hyper-parameter as a float: finite and within its range, else a ValueError saying both."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: {name} must be a number, found {value!r}") from None
    below = low is not None and (v <= low if low_open else v < low)
    above = high is not None and (v >= high if high_open else v > high)
    if not math.isfinite(v) or below or above:
        lo = "(-inf" if low is None else ("(" if low_open else "[") + f"{low:g}"
        hi = "inf)" if high is None else f"{high:g}" + (")" if high_open else "]")
        raise ValueError(f"{where}: {name} must be a finite number in {lo}, {hi}, found {value!r}")
    return v


NONFINITE = ("skip", "raise", "apply")


class Optimizer:
    """Common machinery: learning rate and schedule, L2 weight decay, per-parameter multipliers
    (`param.lr_mult`, `param.decay_mult`), global-norm clipping, the step counter, and what a
    non-finite loss or gradient does (`nonfinite`, see the module docstring)."""

    def __init__(self, params: Any, lr: float, weight_decay: float = 0.0, clip_norm: Optional[float] = None,
                 schedule: Optional[Callable[[int], float]] = None, backend: Any = None,
                 nonfinite: str = "skip") -> None:
        where = type(self).__name__
        params = params.parameters() if hasattr(params, "parameters") else list(params)
        if not params:
            raise ValueError(f"{where}: no parameters to optimize")
        lr = hyper(where, "lr", lr, 0, low_open=True)
        weight_decay = hyper(where, "weight_decay", weight_decay, 0)
        if clip_norm is not None:
            clip_norm = hyper(where, "clip_norm", clip_norm, 0, low_open=True)
        if nonfinite not in NONFINITE:
            raise ValueError(f"{where}: nonfinite must be one of {', '.join(NONFINITE)}, found {nonfinite!r}")
        self.nonfinite = nonfinite
        self.skipped_steps = 0  # steps skipped for a non-finite loss or gradient
        self.last_step_skipped = False
        self._skip = None  # why the current step is being skipped, or None
        self.params = list({id(p): p for p in params}.values())
        self._ids = {id(p) for p in self.params}
        self.lr, self.weight_decay, self.clip_norm = float(lr), float(weight_decay), clip_norm
        self.schedule = schedule or Constant()
        self.backend = backend  # None: each parameter's own (where its values live)
        self.step_count = 0  # completed steps
        self.current_lr = self.lr * self.schedule(0)
        self.last_grad_norm = None
        self._deferred: list = []
        # lamina.distributed.data_parallel installs one: gradients are summed over the
        # processes before their updates
        self.reducer = None

    def begin_step(self):
        self.current_lr = self.lr * self.schedule(self.step_count)
        self._deferred = []
        self._skip = None
        if self.reducer is not None:
            self.reducer.begin()

    def check_loss(self, loss):
        """Before backward: False (skip the step) or FloatingPointError for a non-finite loss."""
        if self.nonfinite == "apply" or loss is None or math.isfinite(loss):
            return True
        self._refuse(f"the loss is {loss}")
        return False

    def _refuse(self, what):
        if self.nonfinite == "raise":
            for p in self.params:  # the step ends here: no gradient carries over to the next
                p.drop_grad()
            self._deferred = []
            raise FloatingPointError(f"{type(self).__name__}: {what}, so the step stops without applying it "
                                     f"(nonfinite='raise')")
        self._skip = what

    def _finite_grad(self, p):
        """Whether p's gradient (its rows, for a sparse one) is finite."""
        return math.isfinite(self._be(p).sum_squares(p.grad, p.grad_rows))

    def update(self, p):
        """The gradient of p is complete: apply its update (or defer it when clipping); in
        data-parallel training, once the gradient is summed over the processes."""
        if id(p) not in self._ids or not p.grad_pending:
            return
        if self.reducer is not None:
            self.reducer.submit(p)  # calls update_summed(p) once the sum has arrived
        else:
            self.update_summed(p)

    def sum_over_processes(self, values):
        """The sum over the data-parallel processes of a small float64 vector (the costs' sums
        and row counts); the values themselves in one process."""
        return values if self.reducer is None else self.reducer.sum(values)

    def update_summed(self, p):
        """Apply p's update (its gradient is that of the whole global batch)."""
        if self._skip is not None:
            p.drop_grad()
            return
        if self.clip_norm is None and (self.nonfinite == "apply" or not self._be(p).reads_wait):
            if self.nonfinite != "apply" and not self._finite_grad(p):
                self._refuse(f"the gradient of '{p.name}' holds NaN or infinity")
                p.drop_grad()
                return
            self._apply(p)
        else:  # clipping needs every gradient's norm; where reads wait for the device, one read checks all
            self._deferred.append(p)

    def _be(self, p):
        """The backend that holds p."""
        return self.backend or p.backend or _cpu()

    def _sums_of_squares(self, params, dense):
        """Each parameter's gradient's sum of squares (of the dense gradient, or of its rows), one
        read per backend (Backend.sums_of_squares)."""
        by_backend = {}
        for i, p in enumerate(params):
            be = self._be(p)
            item = (p.dense_grad(be), None) if dense else (p.grad, p.grad_rows)
            by_backend.setdefault(id(be), (be, []))[1].append((i, item))
        sums = [0.0] * len(params)
        for be, items in by_backend.values():
            for (i, _), v in zip(items, be.sums_of_squares([item for _, item in items])):
                sums[i] = v
        return sums

    def end_step(self):
        if self.reducer is not None:
            self.reducer.finish()
        norm = None
        if self._deferred:
            sums = self._sums_of_squares(self._deferred, dense=self.clip_norm is not None)
            if self.clip_norm is not None:
                norm = math.sqrt(sum(sums))
                if self.nonfinite != "apply" and not math.isfinite(norm):
                    self._refuse(f"the gradients' norm is {norm}")
            else:
                bad = next((p for p, v in zip(self._deferred, sums) if not math.isfinite(v)), None)
                if bad is not None and self.nonfinite != "apply":
                    self._refuse(f"the gradient of '{bad.name}' holds NaN or infinity")
            if self._skip is not None:
                for p in self._deferred:
                    p.drop_grad()
                self._deferred = []
        self.last_step_skipped = self._skip is not None
        if self.last_step_skipped:
            self.skipped_steps += 1
            self._skip = None
            return
        if self._deferred:
            self.last_grad_norm = norm
            scale = min(1.0, self.clip_norm / (norm + 1e-6)) if norm is not None else 1.0
            for p in self._deferred:
                if scale < 1.0:
                    self._be(p).axpby(scale, p.grad, 0.0, p.grad)
                self._apply(p)
            self._deferred = []
        self.step_count += 1

    def step(self) -> None:
        """Update every parameter holding a gradient (for use after a plain net.backward())."""
        self.begin_step()
        for p in self.params:
            if p.grad_pending and not p.frozen:
                self.update(p)
        self.end_step()

    def _apply(self, p):
        lr, weight_decay = self.current_lr * p.lr_mult, self.weight_decay * p.decay_mult
        # a sparse gradient (embedding rows) updates only its rows where that is exact
        if p.grad_rows is None or not self.apply_rows(p, lr, weight_decay):
            p.dense_grad(self._be(p))
            self.apply(p, lr, weight_decay)
        p.drop_grad()
        p.changed()

    def apply_rows(self, p, lr, weight_decay):
        """Update only p.grad_rows and return True, where that equals the dense update with the
        other rows' gradient zero; return False to have the gradient made dense instead."""
        return False

    def _state(self, p, name):
        """A state array of p, zero-initialised on first use."""
        a = p.state.get(name)
        if a is None or a.shape != p.shape or a.dtype != p.dtype:
            a = p.state[name] = self._be(p).zeros(p.shape, p.dtype)
        return a

    def _count(self, p):
        """Per-parameter update count (1 on the first update), kept in the state for resuming."""
        n = int(p.state.get("step", np.zeros((), np.int64))) + 1
        p.state["step"] = np.array(n, np.int64)
        return n

    def apply(self, p, lr, weight_decay):
        raise NotImplementedError


class SGD(Optimizer):
    """SGD with optional momentum (PyTorch's form, with dampening) and Nesterov momentum.

    A sparse gradient (embedding or selective-layer rows) updates only its rows: exact for plain
    SGD. Momentum would keep moving rows without a gradient, so with momentum the update is
    dense unless lazy=True: then only rows with a gradient update their velocity and move
    (lazy momentum: a row's velocity decays only on the steps that touch it)."""

    def __init__(self, params: Any, lr: float, momentum: float = 0.0, dampening: float = 0.0, nesterov: bool = False,
                 lazy: bool = False, **kw: Any) -> None:
        super().__init__(params, lr, **kw)
        momentum = hyper("SGD", "momentum", momentum, 0, 1)
        dampening = hyper("SGD", "dampening", dampening, 0, 1, high_open=False)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum needs momentum > 0 and dampening = 0")
        self.momentum, self.dampening, self.nesterov = momentum, dampening, bool(nesterov)
        self.lazy = bool(lazy)

    def apply_rows(self, p, lr, weight_decay):
        if weight_decay or (self.momentum and not self.lazy):  # these move rows without a gradient
            return False
        v = self._state(p, "momentum_buffer") if self.momentum else None
        self._be(p).sgd_update_rows(p.buffer, p.grad, v, p.grad_rows, lr, self.momentum, self.dampening,
                                     self.nesterov)
        return True

    def apply(self, p, lr, weight_decay):
        v = self._state(p, "momentum_buffer") if self.momentum else None
        self._be(p).sgd_update(p.buffer, p.grad, v, lr, self.momentum, self.dampening, self.nesterov,
                                weight_decay)


class Adam(Optimizer):
    """Adam with bias correction; weight_decay is L2 added to the gradient (torch.optim.Adam).

    A sparse gradient makes a dense update (the moments of rows without a gradient still decay
    and those rows still move) unless lazy=True: then only rows with a gradient update their
    moments and move, with the bias correction of the parameter's update count (TensorFlow's
    LazyAdam, torch.optim.SparseAdam). Without weight decay only."""

    decoupled = False

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 lazy: bool = False, **kw: Any) -> None:
        super().__init__(params, lr, **kw)
        where = type(self).__name__
        self.beta1, self.beta2 = (hyper(where, f"betas[{i}]", b, 0, 1) for i, b in enumerate(betas))
        self.eps = hyper(where, "eps", eps, 0, low_open=True)
        self.lazy = bool(lazy)

    def apply_rows(self, p, lr, weight_decay):
        if not self.lazy or weight_decay:
            return False
        self._be(p).adam_update_rows(p.buffer, p.grad, self._state(p, "exp_avg"), self._state(p, "exp_avg_sq"),
                                      p.grad_rows, lr, self.beta1, self.beta2, self.eps, self._count(p))
        return True

    def apply(self, p, lr, weight_decay):
        self._be(p).adam_update(p.buffer, p.grad, self._state(p, "exp_avg"), self._state(p, "exp_avg_sq"),
                                 lr, self.beta1, self.beta2, self.eps, weight_decay, self.decoupled,
                                 self._count(p))


class AdamW(Adam):
    """Adam with decoupled weight decay: p *= 1 - lr * weight_decay (torch.optim.AdamW)."""

    decoupled = True

    def __init__(self, params: Any, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, **kw: Any) -> None:
        super().__init__(params, lr, betas, eps, weight_decay=weight_decay, **kw)


class AdaGrad(Optimizer):
    """AdaGrad: s += g²; p -= lr g / (sqrt(s) + eps)."""

    def __init__(self, params: Any, lr: float = 1e-2, eps: float = 1e-10, **kw: Any) -> None:
        super().__init__(params, lr, **kw)
        self.eps = hyper("AdaGrad", "eps", eps, 0, low_open=True)

    def apply_rows(self, p, lr, weight_decay):
        if weight_decay:
            return False
        self._be(p).adagrad_update_rows(p.buffer, p.grad, self._state(p, "sum"), p.grad_rows, lr, self.eps)
        return True

    def apply(self, p, lr, weight_decay):
        self._be(p).adagrad_update(p.buffer, p.grad, self._state(p, "sum"), lr, self.eps, weight_decay)


class RMSProp(Optimizer):
    """RMSProp (torch.optim.RMSprop, not centered): s = alpha s + (1-alpha) g²."""

    def __init__(self, params: Any, lr: float = 1e-2, alpha: float = 0.99, eps: float = 1e-8, momentum: float = 0.0,
                 **kw: Any) -> None:
        super().__init__(params, lr, **kw)
        self.alpha = hyper("RMSProp", "alpha", alpha, 0, 1)
        self.eps = hyper("RMSProp", "eps", eps, 0, low_open=True)
        self.momentum = hyper("RMSProp", "momentum", momentum, 0, 1)

    def apply(self, p, lr, weight_decay):
        buf = self._state(p, "momentum_buffer") if self.momentum else None
        self._be(p).rmsprop_update(p.buffer, p.grad, self._state(p, "square_avg"), buf, lr, self.alpha,
                                    self.eps, weight_decay, self.momentum)
