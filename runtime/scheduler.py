"""Runs a Network: forward, backward with gradient accumulation, per-parameter update callbacks,
and buffer planning.

Decided once per network and kind of run (a Plan), never per step:
- the topological order and which nodes a run needs;
- which values need a gradient, which nodes run backward, and, for every (node, input slot),
  whether that backward overwrites the input's gradient (the first writer in backward order,
  beta = 0) or adds to it (every later writer, beta = 1), so a value used by several layers gets
  the sum of their gradients with no split copies and no zero-fill;
- for every parameter, the node whose backward is its last use, after which its update fires.
Allocated once per plan and caller, sized by capacity (Bindings): every value, gradient and
workspace array, grown to the largest batch seen and viewed at each batch's size. In inference a
value's buffer goes back to a pool after its last consumer and is reused by later values of the
same shape, so peak memory is the widest cut of the graph rather than the sum of activations.
An inference binding that grew for an outlier (a batch far larger than the plan's recent ones)
is dropped after it, and the freed heap handed back to the system, so a long-running process's
memory follows its usual batches, not its largest one. In inference, too, an element-wise
activation whose input nothing else reads runs inside the layer that writes that input, when
the layer can apply it as it stores its output (a convolution's kernels add the bias and apply
a ReLU in the same pass): the activation's output is the producer's buffer, and the activation
node does not run.
"""
import collections
import ctypes
import ctypes.util
import math
import statistics
import threading
import weakref
from contextlib import contextmanager

import numpy as np

from .errors import GraphError, InputError
from .selection import Selection
from .sequence import SequenceError, Sequences, _check_starts

_INT32 = np.iinfo(np.int32)


def _check_fits_int32(a, where):
    """Integer ids narrowed to int32 must keep their values (2**32 + 5 must not become 5)."""
    if a.dtype == np.int32 or a.size == 0:
        return
    lo, hi = a.min(), a.max()
    if lo < _INT32.min or hi > _INT32.max:
        flat = a.reshape(-1)
        at = int(np.flatnonzero((flat < _INT32.min) | (flat > _INT32.max))[0])
        raise InputError(f"{where}: ids must fit int32 [{_INT32.min}, {_INT32.max}], found {flat[at]} "
                         f"at position {at}")


class GradTarget:
    """Where a backward writes one gradient, and how: out = new + beta * out."""

    __slots__ = ("array", "beta")

    def __init__(self, array, beta):
        self.array, self.beta = array, beta


class Context:
    """What a layer's forward and backward see for one node: arrays, gradients, workspaces."""

    __slots__ = ("node", "layer", "be", "bindings", "training", "precision", "activation", "pool", "_in", "_out",
                 "_in_grads")

    def __init__(self, node, bindings, in_grads):
        self.node, self.layer, self.bindings = node, node.layer, bindings
        self.be = bindings.backend
        self.training = bindings.plan.training
        # how this run multiplies by the weights (lamina.precision): the network's precision at
        # inference, its training precision (Network.autocast) in training
        network = bindings.network
        self.precision = network.training_precision if self.training else network.precision
        # (kind, slope) of an activation this node's forward applies to its output (fused from
        # the Activation node that follows it), or None
        self.activation = bindings.plan.fused.get(node.name)
        self._in = [v.name for v in node.inputs]
        self._out = node.outputs
        # the window of a max pool this node's forward applies to its output (fused from the
        # MaxPool node that follows it, whose output is then this node's), or None
        pooled = bindings.plan.pooled.get(node.name)
        self.pool = pooled[0] if pooled else None
        if pooled:
            self._out = [pooled[1]]
        self._in_grads = in_grads  # per slot: beta (0.0 or 1.0), or None for no gradient

    @property
    def rng(self):
        """The network's generator (dropout masks)."""
        return self.bindings.network.rng

    @property
    def inputs(self):
        values = self.bindings.values
        return [values[n] for n in self._in]

    @property
    def output(self):
        return self.bindings.values[self._out[0]]

    @property
    def outputs(self):
        values = self.bindings.values
        return [values[n] for n in self._out]

    def unpooled_shape(self):
        """The shape of this node's own output before a fused max pool (Context.pool)."""
        return (self.batch,) + self.bindings.network.values[self.node.outputs[0]].spec.shape

    @property
    def batch(self):
        """Samples in the batch (sequences, for a sequence batch)."""
        return self.bindings.batch

    @property
    def starts(self):
        """The sequence offsets of this batch (int32, num_sequences + 1), or None."""
        return self.bindings.starts

    @property
    def order(self):
        """The time-major BatchOrder of this batch, computed once and shared by every layer."""
        return self.bindings.batch_order()

    @property
    def grad_output(self):
        return self.bindings.grads.get(self._out[0])

    @property
    def grad_outputs(self):
        """The gradient of each output, or None for an output no gradient reaches."""
        grads = self.bindings.grads
        return [grads.get(n) for n in self._out]

    def host_input(self, slot):
        """Input `slot` as a numpy array: the user's own array when the input is one the caller
        fed (no copy from the device), else a copy from the device."""
        name = self._in[slot]
        host = self.bindings.host_feeds.get(name)
        if host is not None:
            return host
        return self.be.to_host(self.bindings.values[name])

    def input_grad(self, slot):
        """Where to write the gradient of input `slot`, or None when none is needed."""
        beta = self._in_grads[slot]
        if beta is None:
            return None
        return GradTarget(self.bindings.grads[self._in[slot]], beta)

    def param_grad(self, name):
        """Where to write a parameter's gradient, or None when it is frozen. The first writer
        since the last update overwrites; every later one (a shared weight, a second backward
        without an update) adds."""
        p = self.layer.params[name]
        return None if p.frozen else GradTarget(*p.grad_target(self.be))

    def sparse_param_grad(self, name, ids):
        """The gradient array of a parameter whose gradient touches only rows `ids` (int32,
        may repeat), or None when it is frozen. The rows are zeroed on first touch, so the
        caller always adds (scatter_add_rows); the other rows are never written."""
        rows = np.unique(ids).astype(np.int32)
        target = self.sparse_param_target(name, rows)
        if target is None:
            return None
        if target.beta == 0:
            self.be.fill_rows(target.array, rows, 0)
        return target.array

    def sparse_param_target(self, name, rows):
        """Where to write a parameter's gradient that touches only `rows` (sorted, distinct
        int32), or None when it is frozen: beta 0 means the rows are fresh (overwrite them),
        beta 1 that they hold gradient already (add; rows new to a sparse gradient are zeroed
        here first). Rows not listed are never written and count as zero."""
        p = self.layer.params[name]
        return None if p.frozen else GradTarget(*p.sparse_grad_target(self.be, rows))

    def selected_output(self, selection, rows):
        """Size this node's (selected) output, and its gradient in training, for `selection`
        over `rows` rows; returns the output array."""
        return self.bindings.size_selected(self._out[0], selection, rows)

    def workspace(self, key, shape, dtype=None):
        """A scratch array owned by this node (allocated once per batch size; reused while
        it is big enough)."""
        return self.bindings.workspace(self.node.name, key, shape, dtype)


class Plan:
    """The static part of one kind of run: nodes, gradient flow and update points."""

    def __init__(self, scheduler, training, outputs, grad_outputs=()):
        net = scheduler.network
        self.training, self.outputs = training, outputs
        wanted = {net.output_values[o] for o in outputs}
        self.nodes = scheduler.ancestors(wanted)
        names = {out for n in self.nodes for out in n.outputs}
        self.inputs = [v for v in net.input_names
                       if v in wanted or any(i.name == v for n in self.nodes for i in n.inputs)]
        self.values = self.inputs + [out for n in self.nodes for out in n.outputs]
        # where backward starts: the costs among the outputs, or outputs whose gradient the
        # caller hands to backward (as torch's y.backward(g))
        self.costs = [v for v in wanted if v in names and scheduler.producer[v].layer.is_cost]
        self.given = [net.output_values[o] for o in grad_outputs]
        self.seeds = self.given or self.costs
        self.given_written = set()  # given gradients that layers add to (the rest are only read)
        self.backward_nodes, self.in_betas, self.grad_values, self.fires = [], {}, [], {}
        # inference: producer node -> the activation it applies; output of a fused activation or a
        # view -> its input; producer node -> (window, output) of the max pool it applies, and
        # the names of those pool nodes (they do not run)
        self.fused, self.aliases, self.pooled, self.absorbed = {}, {}, {}, set()
        if training:
            self._plan_gradients(net)
        else:
            self._fuse_activations(scheduler, wanted)
        # inference: position of each value's last use, for buffer reuse
        self.last_use = {}
        for i, n in enumerate(self.nodes):
            for v in n.inputs:
                self.last_use[v.name] = i

    def _fuse_activations(self, scheduler, wanted):
        """An activation node (Layer.as_activation) whose input only it reads, and that the
        input's producer can apply to its own output (Layer.fuses_activation), runs inside the
        producer: its output becomes an alias of its input. A view node (Layer.is_view: a
        reshape) whose input only it reads does not run: its output is an alias of its input,
        seen in its own shape."""
        readers = {}
        for n in self.nodes:
            for v in {v.name for v in n.inputs}:
                readers[v] = readers.get(v, 0) + 1
        net = scheduler.network
        for n in self.nodes:
            activation = n.layer.as_activation()
            if activation is None and not (n.layer.is_view() and len(n.inputs) == 1):
                continue
            v = n.inputs[0].name
            p = scheduler.producer.get(v)
            if p is None or readers[v] != 1 or v in wanted or net.values[v].spec.selected:
                continue
            if activation is None:  # (a view of any output, the LSTM's among its three)
                self.aliases[n.output] = v
            elif len(p.outputs) == 1 and p.name not in self.fused and p.layer.fuses_activation(activation[0]):
                self.fused[p.name] = activation
                self.aliases[n.output] = v
        self._fuse_pools(scheduler, wanted, readers)

    def _fuse_pools(self, scheduler, wanted, readers):
        """A max pool (Layer.as_max_pool) whose input only it reads, the output of a layer that can
        pool its own output (Layer.fuses_max_pool; through a fused activation), runs inside that
        layer when nothing runs between them: the layer's forward writes the pool's output."""
        position = {n.name: i for i, n in enumerate(self.nodes)}
        net = scheduler.network
        for n in self.nodes:
            window = n.layer.as_max_pool()
            if window is None:
                continue
            v = n.inputs[0].name
            own = self.aliases.get(v, v)  # the producer's output (v may be its fused activation's)
            p = scheduler.producer.get(own)
            if (p is None or readers[v] != 1 or v in wanted or own in wanted or len(p.outputs) != 1
                    or net.values[own].spec.selected or not p.layer.fuses_max_pool()):
                continue
            between = self.nodes[position[p.name] + 1:position[n.name]]
            if any(m.output != v or v not in self.aliases for m in between):
                continue  # (only the fused activation between them)
            self.pooled[p.name] = (window, n.output)
            self.absorbed.add(n.name)

    def _plan_gradients(self, net):
        requires = {v: net.values[v].requires_grad and net.values[v].spec.kind == "float"
                    for v in self.inputs}
        for n in self.nodes:
            trainable = any(not p.frozen for p in n.layer.params.values())
            flag = trainable or any(requires[v.name] for v in n.inputs)
            for out in n.outputs:
                requires[out] = flag
        reaches = {v: False for v in self.values}
        for v in self.seeds:
            reaches[v] = True
        written = set(self.seeds)
        last_user = {}
        for n in reversed(self.nodes):
            if not (requires[n.output] and any(reaches[out] for out in n.outputs)):
                continue
            self.backward_nodes.append(n)
            grad_slots = n.layer.grad_slots(len(n.inputs))
            betas = []
            for slot, v in enumerate(n.inputs):
                if slot in grad_slots and requires[v.name] and v.spec.kind == "float":
                    if v.name in self.given:
                        self.given_written.add(v.name)
                    betas.append(1.0 if v.name in written else 0.0)
                    written.add(v.name)
                    reaches[v.name] = True
                else:
                    betas.append(None)
            self.in_betas[n.name] = betas
            for p in n.layer.params.values():
                if not p.frozen:
                    last_user[id(p)] = (n.name, p)
        self.grad_values = [v for v in self.values if reaches[v]]
        for node_name, p in last_user.values():
            self.fires.setdefault(node_name, []).append(p)


class Bindings:
    """The arrays of one plan for one caller at a time, reused for every batch.

    Buffers are sized by capacity: each value (or group of values that share a buffer) has a flat
    base array that grows to the largest batch seen, and every batch gets views of its first
    entries, so batches of varying shape reuse the same memory instead of caching arrays per
    shape. Contexts refer back to their bindings weakly, so dropping a Bindings frees it at once
    (no reference cycle waits for the cycle collector)."""

    GROWTH = 1.25  # a base that must grow takes this much headroom, so slowly rising sizes settle

    def __init__(self, scheduler, plan):
        net = scheduler.network
        self.network, self.backend, self.plan = net, net.backend, plan
        self.batch, self.steps = None, None  # samples (or sequences); total steps of sequences
        self.starts, self._order = None, None  # set for each batch by the scheduler
        self.values, self.grads, self._workspaces = {}, {}, {}
        self.workspace_bytes = 0  # bytes of workspace the layers asked for in the current run
        self.host_feeds = {}  # the arrays the kernels read behind each fed input (host side)
        self._feed_bases = {}  # input name -> (flat host buffer, its current view) for snapshots
        # selected values (one per entry of the batch's selection) change length from batch to
        # batch: their writer sizes them in buffers that grow as needed (size_selected)
        self._selected, self.layouts = {}, {}
        # (store, value name) -> buffer slot; slot -> (per-row shape, dtype, sequence); slot -> base
        self._slot_of, self._slot_key, self._bases = {}, {}, {}
        if plan.training:
            for n in plan.nodes:
                for out in n.outputs:
                    if not self._is_selected(out):
                        self._own_slot("value", out)
            for v in plan.grad_values:
                if not self._is_selected(v):
                    self._own_slot("grad", v)
            for p in net.parameters():
                if not p.frozen:
                    p.ensure_grad(self.backend)
        else:
            self._share_slots(plan)
        me = weakref.proxy(self)
        self.contexts = [(n, Context(n, me, plan.in_betas.get(n.name))) for n in plan.nodes
                         if n.output not in plan.aliases and n.name not in plan.absorbed]
        # backward runs in reverse topological order; after a node, the updates it completes
        self.backward_contexts = [(c, plan.fires.get(n.name, ())) for n, c in reversed(self.contexts)
                                  if n.name in plan.in_betas]

    def _row_key(self, vname):
        spec = self.network.values[vname].spec
        dtype = self.network.dtype if spec.kind == "float" else np.dtype(np.int32)
        return spec.shape, dtype, spec.sequence

    def _own_slot(self, store, vname):
        slot = len(self._slot_key)
        self._slot_key[slot] = self._row_key(vname)
        self._slot_of[(store, vname)] = slot

    def _share_slots(self, plan):
        """Inference: a value's buffer returns to a pool after its last consumer and later values
        of the same per-row shape reuse it (same per-row shape means same size at every batch)."""
        free = {}  # row key -> free slots
        keep = {self.network.output_values[o] for o in plan.outputs}
        aliased = set(plan.aliases.values())  # live on in their alias's name
        pooled_outputs = {out for _, out in plan.pooled.values()}
        for i, n in enumerate(plan.nodes):
            # a node that pools its output writes the pool's: that buffer is taken here, before
            # the node's inputs are freed (never one of them)
            extra = [plan.pooled[n.name][1]] if n.name in plan.pooled else []
            for out in n.outputs + extra:
                if self._is_selected(out) or (out in pooled_outputs and not extra):
                    continue
                if out in plan.aliases:
                    self._slot_of[("value", out)] = self._slot_of[("value", plan.aliases[out])]
                    continue
                key = self._row_key(out)
                if free.get(key):
                    self._slot_of[("value", out)] = free[key].pop()
                else:
                    self._own_slot("value", out)
            for v in {v.name for v in n.inputs}:
                if (plan.last_use.get(v) == i and ("value", v) in self._slot_of and v not in keep
                        and v not in aliased and not self._is_selected(v)):
                    slot = self._slot_of[("value", v)]  # (filed under its own shape: an alias's may differ)
                    free.setdefault(self._slot_key[slot], []).append(slot)

    def resize(self, batch, steps):
        """Point every value and gradient at views for this batch size, growing the bases that
        are too small (to the largest size seen, with headroom); for the same size, only the
        values of slots whose buffer was given away (release_buffer) get new ones."""
        if (batch, steps) == (self.batch, self.steps):
            slots = [slot for slot in self._slot_key if slot not in self._bases]
            if not slots:
                return
        else:
            slots = self._slot_key
        self.batch, self.steps = batch, steps
        sizes = {}
        for slot in slots:
            shape, dtype, sequence = self._slot_key[slot]
            rows = steps if sequence else batch
            need = (rows or 0) * math.prod(shape)
            self._bases[slot] = self._grown(self._bases.get(slot), need, dtype, self.backend.empty)
            sizes[slot] = rows or 0, need
        for (store, vname), slot in self._slot_of.items():
            if slot not in sizes:
                continue
            rows, need = sizes[slot]  # (each value in its own shape: an alias may see its slot in another)
            shape = (rows,) + self._row_key(vname)[0]
            (self.values if store == "value" else self.grads)[vname] = self._bases[slot][:need].reshape(shape)

    def release_buffer(self, vname):
        """Give up the buffer behind value `vname` (its holder keeps it; the next batch writes to
        a new one): an output handed to the caller without a copy (copying large logits is a
        visible share of a run). False where the value has no buffer
        of this binding's (a fed input, a selected value: neither has a slot)."""
        slot = self._slot_of.get(("value", vname))
        if slot is None:
            return False
        self._bases.pop(slot, None)  # (resize makes the new one)
        return True

    @classmethod
    def _grown(cls, base, need, dtype, empty):
        """`base` if it holds `need` values, else a new flat buffer from empty(shape, dtype) with
        GROWTH headroom over the old one."""
        if base is not None and base.size >= need:
            return base
        return empty((max(need, int(base.size * cls.GROWTH) if base is not None else 0, 1),), dtype)

    def feed(self, name, a, dtype):
        """The array the kernels read for input `name`: the caller's own array when the backend
        can read it as it is, else a snapshot in this binding's buffer (ids and labels always:
        they index memory, so they are checked once and must not change behind the check)."""
        if a.dtype == dtype and a.dtype.kind == "f" and a.flags.c_contiguous and a.flags.aligned \
                and a.flags.writeable:
            return a
        old, out = self._feed_bases.get(name, (None, None))
        base = self._grown(old, a.size, dtype, np.empty)
        if base is not old or out.shape != a.shape:
            # one view per shape, kept: a device backend's upload cache knows it by identity
            out = base[:a.size].reshape(a.shape)
        self._feed_bases[name] = (base, out)
        np.copyto(out, a, casting="unsafe")
        return out

    def _is_selected(self, vname):
        return self.network.values[vname].spec.selected

    def size_selected(self, vname, selection, rows):
        """Point a selected value (and its gradient) at the first entries of a buffer that grows
        as needed, and remember the layout for handing the value out."""
        n = selection.num_entries(rows)
        for store, key in ((self.values, "value"), (self.grads, "grad")):
            if key == "grad" and vname not in self.plan.grad_values:
                continue
            base = self._selected.get((vname, key))
            if base is None or len(base) < n:
                base = self._selected[(vname, key)] = self.backend.empty(
                    (max(n, 2 * len(base) if base is not None else n),), self.network.dtype)
            store[vname] = base[:n]
        self.layouts[vname] = (selection, rows)
        return self.values[vname]

    def host_value(self, vname, copy=True):
        """A value as the user gets it: an array of its own (copy=False: a view of the buffer
        where the backend keeps it on the host); a Sequences for sequence values; a selected
        value in its selection's layout. On a backend of host arrays, a value with a buffer of
        its own is handed over as it is, not copied (release_buffer)."""
        a = self.backend.to_host(self.values[vname])
        if copy and self.backend.host_arrays:
            a = a if self.release_buffer(vname) else np.array(a)
        a = np.asarray(a)
        if self._is_selected(vname):
            selection, rows = self.layouts[vname]
            return selection.unpack(a, rows)
        return Sequences.unchecked(a, self.starts.copy()) if self.network.values[vname].spec.sequence else a

    def rows(self, vname):
        return self.steps if self.network.values[vname].spec.sequence else self.batch

    def batch_order(self):
        if self._order is None:
            if self.starts is None:
                raise GraphError("this batch has no sequences: a layer asked for the sequence order")
            from .sequence import BatchOrder
            self._order = BatchOrder(self.starts)
        return self._order

    def buffer_bytes(self, batch, steps):
        """Bytes of the planned value and gradient buffers that `batch` samples of `steps` steps
        in all (None: no sequences) take (workspaces and feed copies not counted)."""
        return sum(((steps or 0) if sequence else batch) * math.prod(shape) * dtype.itemsize
                   for shape, dtype, sequence in self._slot_key.values())

    def drop_buffers(self):
        """Let go of every array this binding holds (it is not used again)."""
        for store in (self._bases, self._feed_bases, self._selected, self._workspaces, self.values, self.grads):
            store.clear()

    def held_bytes(self):
        """Bytes this binding holds now: buffers, feed snapshots, selected values, workspaces."""
        arrays = [*self._bases.values(), *(base for base, _ in self._feed_bases.values()),
                  *self._selected.values(), *self._workspaces.values()]
        return sum(a.nbytes for a in arrays)

    def workspace(self, node_name, key, shape, dtype=None):
        full = (node_name, key)
        dtype = np.dtype(dtype or self.network.dtype)
        shape = tuple(map(int, shape))
        size = math.prod(shape)
        self.workspace_bytes += size * dtype.itemsize
        a = self._workspaces.get(full)
        if a is None or a.dtype != dtype or a.size < size:
            a = self._workspaces[full] = self.backend.empty((size,), dtype)
        return a[:size].reshape(shape)


_libc = None


def release_free_heap():
    """Hand the C heap's free pages back to the system (glibc's malloc_trim): arrays below the
    allocator's mmap threshold, which rises to 32 MB as large blocks are freed, come from the
    heap, and freeing them alone leaves the process's resident size where it was."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    if _libc and hasattr(_libc, "malloc_trim"):
        _libc.malloc_trim(0)


class Scheduler:
    """Executes a validated network (see the module docstring).

    Inference runs may come from many threads at once: each takes a Bindings of its own from a
    pool per plan (created on demand, at most IDLE_PER_PLAN kept when idle) and returns it after,
    so no two runs share a buffer; parameters are only read. Training (forward, backward) runs
    one at a time under the network's write lock and keeps its bindings as `current`."""

    IDLE_PER_PLAN = 4
    RECENT_RUNS = 16  # inference runs per plan whose buffer sizes set what is usual
    OUTLIER_FACTOR = 4  # a binding holding more than this many times the usual size is dropped
    OUTLIER_SLACK = 16 << 20  # ... and more than this many bytes over it

    def __init__(self, network, order):
        # weakly, like everything a network owns that points back at it: no reference cycles,
        # so a dropped network frees its buffers at once
        self.network, self.order = weakref.proxy(network), order
        self.producer = {out: n for n in order for out in n.outputs}
        self._plans = {}
        self._idle = {}  # id(plan) -> idle inference Bindings
        self._training = {}  # id(plan) -> the training Bindings of that plan
        self._recent = {}  # id(plan) -> buffer bytes of its last RECENT_RUNS inference runs
        self._sizers = {}  # id(plan) -> a Bindings that only sizes (inference_bytes)
        self._workspace_ratio = {}  # id(plan) -> the largest (buffers + workspaces) / buffers of its runs
        self._lock = threading.Lock()
        self.current = None  # the bindings of the last training forward, for backward

    def ancestors(self, wanted):
        need, stack = set(), list(wanted)
        while stack:
            v = stack.pop()
            n = self.producer.get(v)
            if n is not None and n.name not in need:
                need.add(n.name)
                stack.extend(i.name for i in n.inputs)
        return [n for n in self.order if n.name in need]

    def plan(self, training, outputs, grad_outputs=()):
        key = (training, tuple(outputs), tuple(grad_outputs))
        plan = self._plans.get(key)
        if plan is None:
            plan = Plan(self, training, tuple(outputs), tuple(grad_outputs))
            with self._lock:
                plan = self._plans.setdefault(key, plan)
        return plan

    @contextmanager
    def borrowed(self, plan):
        """An idle Bindings of `plan` for the duration of one inference run."""
        with self._lock:
            idle = self._idle.setdefault(id(plan), [])
            b = idle.pop() if idle else None
        if b is None:
            b = Bindings(self, plan)
        try:
            yield b
        finally:
            b.host_feeds = {}  # the caller's arrays (and the device copies made of them) are not kept
            for name in plan.inputs:
                b.values.pop(name, None)
            held = b.held_bytes()
            with self._lock:
                recent = self._recent.setdefault(id(plan), collections.deque(maxlen=self.RECENT_RUNS))
                recent.append(held)
                outgrown = held > self.OUTLIER_FACTOR * statistics.median(recent) + self.OUTLIER_SLACK
                planned = b.buffer_bytes(b.batch, b.steps) if b.batch is not None else 0
                if planned:
                    ratio = (planned + b.workspace_bytes) / planned
                    self._workspace_ratio[id(plan)] = max(self._workspace_ratio.get(id(plan), 1.0), ratio)
                idle = self._idle.setdefault(id(plan), [])
                if len(idle) < self.IDLE_PER_PLAN and not outgrown:
                    idle.append(b)
            if outgrown:
                b.drop_buffers()  # now: the caller's frame still holds b until its run returns
                release_free_heap()

    def inference_bytes(self, outputs, batch, steps=None):
        """Bytes an inference run of `outputs` over `batch` samples (of `steps` steps in all, for
        sequence inputs) takes: the buffers as this network's plan lays them out, scaled by the
        largest share the layers' workspaces (a recurrent layer's gates) added in this plan's
        runs so far (none before its first run)."""
        plan = self.plan(False, tuple(outputs))
        sizer = self._sizers.get(id(plan))
        if sizer is None:  # a Bindings allocates nothing before its first batch
            sizer = self._sizers[id(plan)] = Bindings(self, plan)
        return int(sizer.buffer_bytes(batch, steps) * self._workspace_ratio.get(id(plan), 1.0))

    def training_bindings(self, plan):
        b = self._training.get(id(plan))
        if b is None:
            b = self._training[id(plan)] = Bindings(self, plan)
        return b

    # ------------------------------------------------------------------ feeds
    def _check_names(self, feeds):
        net = self.network
        if not isinstance(feeds, dict):
            raise InputError(f"feeds must be a dict of input name -> array, found {type(feeds).__name__}")
        unknown = [k for k in feeds if k not in net.input_names]
        if unknown:
            raise InputError(f"unknown input {unknown[0]!r}; this network's inputs are "
                             f"{', '.join(repr(n) for n in net.input_names)}")

    def _check_feeds(self, feeds, needed):
        """Check every needed feed; returns (batch, total steps or None, a snapshot of the sequence
        offsets or None). Arrays may be read-only, strided or of another byte order (they are
        copied where the kernels need it); integer ids of any integer type are accepted when they
        fit int32."""
        net = self.network
        self._check_names(feeds)
        missing = [v for v in needed if v not in feeds]
        if missing:
            raise InputError(f"missing input {missing[0]!r} (needed for this run)")
        batch, starts = None, None
        for name in needed:
            a = feeds[name]
            spec = net.values[name].spec
            dtype = net.dtype if spec.kind == "float" else np.dtype(np.int32)
            where = f"input '{name}'"
            if spec.kind == "selection":
                if not isinstance(a, Selection):
                    raise InputError(f"{where}: expected a lamina.Selection (the columns to score), "
                                     f"found {type(a).__name__}")
                continue  # its rows are checked by the layers that read it
            if spec.sequence:
                if not isinstance(a, Sequences):
                    raise InputError(f"{where}: expected a lamina.Sequences batch (values + starts), "
                                     f"found {type(a).__name__}")
                if starts is None:
                    # a snapshot, checked again: the caller's offsets may have changed since
                    try:
                        starts = _check_starts(np.array(a.starts, copy=True), len(a.values), where)
                    except SequenceError as e:
                        raise InputError(str(e)) from None
                    starts.flags.writeable = False
                elif not np.array_equal(a.starts, starts):
                    raise InputError(f"{where}: its sequence offsets differ from the other sequence "
                                     f"inputs'; every sequence input of a batch shares one set of offsets")
                rows, a = len(starts) - 1, a.values
            elif not isinstance(a, np.ndarray):
                raise InputError(f"{where}: expected a numpy array, found {type(a).__name__}")
            else:
                rows = a.shape[0] if a.ndim else None
            if spec.kind == "float":
                if a.dtype.kind != "f" or a.dtype.itemsize != dtype.itemsize:
                    raise InputError(f"{where}: expected dtype {dtype}, found {a.dtype}")
            else:
                if a.dtype.kind not in "iu":
                    raise InputError(f"{where}: expected integer ids (int32), found {a.dtype}")
                _check_fits_int32(a, where)
            if a.shape[1:] != spec.shape or a.ndim != len(spec.shape) + 1:
                lead = "total_steps" if spec.sequence else "batch"
                dynamic = net.dynamic_axes.get(name, {})
                sizes = [dynamic.get(i, size) for i, size in enumerate(spec.shape)]
                raise InputError(f"{where}: expected shape ({lead}, {', '.join(map(str, sizes))})"
                                 f"{f' i.e. (N,)+{spec.shape}' if not dynamic else ''}, found {a.shape}")
            if batch is None:
                batch = rows
            elif rows != batch:
                raise InputError(f"{where}: batch size {rows} differs from the other inputs' {batch}"
                                 f"{' (a sequence batch counts its sequences)' if starts is not None else ''}")
        if batch == 0:
            raise InputError("the batch is empty: every input has 0 rows")
        return batch, (int(starts[-1]) if starts is not None else None), starts

    def _bind_feeds(self, b, feeds, plan, sizes):
        batch, steps, starts = sizes
        b.resize(batch, steps)
        b.workspace_bytes = 0
        b.starts, b._order = starts, None
        net = self.network
        for name in plan.inputs:
            a = feeds[name]
            if isinstance(a, Selection):
                b.values[name] = a
            else:
                spec = net.values[name].spec
                dtype = net.dtype if spec.kind == "float" else np.dtype(np.int32)
                host = b.feed(name, a.values if isinstance(a, Sequences) else a, dtype)
                b.host_feeds[name] = host
                b.values[name] = net.backend.from_host(host)

    # ------------------------------------------------------------------ runs
    def run(self, feeds, outputs=None, consume=None):
        net = self.network
        self._check_names(feeds)
        if outputs is None:
            # every output computable from what was fed (inference usually feeds no labels)
            outputs = [o for o in net.output_values
                       if all(v in feeds for v in self.plan(False, (o,)).inputs)]
            if not outputs:
                raise InputError(f"no output can be computed from inputs {sorted(feeds)}; the network's "
                                 f"inputs are {', '.join(repr(n) for n in net.input_names)}")
        for o in outputs:
            if o not in net.output_values:
                raise InputError(f"unknown output {o!r}; outputs are {', '.join(map(repr, net.output_values))}")
        plan = self.plan(False, outputs)
        sizes = self._check_feeds(feeds, plan.inputs)
        with self.borrowed(plan) as b:
            self._bind_feeds(b, feeds, plan, sizes)
            for node, ctx in b.contexts:
                node.layer.forward(ctx)
            if consume is not None:
                return consume({o: b.host_value(net.output_values[o], copy=False) for o in outputs})
            return {o: b.host_value(net.output_values[o]) for o in outputs}

    def forward(self, feeds, training=True, grad_outputs=(), outputs=None):
        net = self.network
        outputs = tuple(net.output_values) if outputs is None else tuple(outputs)
        for o in (*grad_outputs, *outputs):
            if o not in net.output_values:
                raise InputError(f"unknown output {o!r}; outputs are {', '.join(map(repr, net.output_values))}")
        missing = [o for o in grad_outputs if o not in outputs]
        if missing:
            raise InputError(f"grad_outputs: '{missing[0]}' is not among the outputs computed")
        plan = self.plan(training, outputs, tuple(grad_outputs))
        sizes = self._check_feeds(feeds, plan.inputs)
        b = self.training_bindings(plan)
        self._bind_feeds(b, feeds, plan, sizes)
        for node, ctx in b.contexts:
            node.layer.forward(ctx)
        self.current = b
        return {o: b.values[net.output_values[o]] for o in outputs}

    def backward(self, on_ready=None, grad_outputs=None, check_loss=None, sum_over_processes=None):
        b = self.current
        net = self.network
        if b is None or not b.plan.training:
            raise GraphError("backward needs a training forward first: call net.forward(feeds, training=True)")
        be = net.backend
        loss = None
        if b.plan.given:
            expected = [o for o in net.output_values if net.output_values[o] in b.plan.given]
            if sorted(grad_outputs or {}) != sorted(expected):
                raise GraphError(f"backward: the forward declared grad_outputs {expected}, "
                                 f"found gradients for {sorted(grad_outputs or {})}")
            for o, g in grad_outputs.items():
                v = net.output_values[o]
                if not isinstance(g, np.ndarray) or g.shape != b.grads[v].shape or g.dtype != b.grads[v].dtype:
                    raise InputError(f"backward: the gradient of output '{o}' must be a {b.grads[v].dtype} "
                                     f"array of shape {b.grads[v].shape}, found "
                                     f"{getattr(g, 'dtype', type(g).__name__)} {getattr(g, 'shape', '')}")
                if v in b.plan.given_written:
                    be.copy(be.from_host(g), b.grads[v])
                else:  # only read by backward: use the caller's array as it is, no copy
                    if not g.flags.c_contiguous:
                        raise InputError(f"backward: the gradient of output '{o}' must be C-contiguous, "
                                         f"found a strided view; pass np.ascontiguousarray(...)")
                    b.grads[v] = be.from_host(g)
        elif not b.plan.costs:
            raise GraphError("backward needs a cost among the network's outputs (e.g. SoftmaxCrossEntropy), "
                             "or forward(..., grad_outputs=[...]) and backward(grad_outputs={...})")
        elif grad_outputs:
            raise GraphError("backward: gradients for outputs need forward(..., grad_outputs=[names])")
        else:
            costs = b.plan.costs
            loss, rows = self._mean_costs([np.sum(be.to_host(b.values[v]), dtype=np.float64) for v in costs],
                                          [b.rows(v) for v in costs], sum_over_processes)
            for v, r in zip(costs, rows):
                be.fill(b.grads[v], 1.0 / r)
        if check_loss is not None and not check_loss(loss):
            return loss
        for ctx, ready in b.backward_contexts:
            ctx.layer.backward(ctx)
            if on_ready is not None:
                for p in ready:
                    on_ready(p)
        return loss

    def backward_without_samples(self, plan, on_ready, check_loss, sum_over_processes):
        """Backward of a data-parallel rank whose share of the global batch is empty: it joins
        the sum of the costs with nothing, then hands every parameter of `plan` a zero gradient
        at its update point, in backward's order, so it joins every gradient exchange."""
        k = len(plan.costs)
        loss, _ = self._mean_costs([0.0] * k, [0] * k, sum_over_processes)
        if check_loss is not None and not check_loss(loss):
            return loss
        for node in plan.backward_nodes:
            for p in plan.fires.get(node.name, ()):
                p.zero_grad(self.network.backend)
                on_ready(p)
        return loss

    @staticmethod
    def _mean_costs(sums, rows, sum_over_processes=None):
        """(loss, each cost's row count): the loss is the mean over rows of each cost (steps,
        for a sequence cost), added up; in data-parallel training `sum_over_processes` makes
        the sums and rows those of the global batch."""
        totals = np.array(list(sums) + list(rows), np.float64)
        if sum_over_processes is not None:
            totals = sum_over_processes(totals)
        k = len(sums)
        loss = 0.0
        for total, r in zip(totals[:k], totals[k:]):
            loss += float(total) / r
        return loss, totals[k:]

    def grad(self, name):
        b = self.current
        if b is None or name not in b.grads:
            raise KeyError(f"no gradient for '{name}': it is not on a path from an input with "
                           f"requires_grad or a trainable parameter to a cost, or backward has not run")
        return b.grads[name]
