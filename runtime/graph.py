"""Network: a DAG of layers with named inputs and outputs.

Layers wire themselves in when called on values (Keras's functional style): `h = Linear(4, 8)(x)`.
`Network.add(layer, ["x", "h"])` does the same with names, which may refer to values added later;
the graph is therefore validated as a whole (unknown names, cycles, shapes) when it is first run
or when `validate()` is called, and every error names the layer at fault.
"""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional, Sequence, Union

import numpy as np

from .errors import GraphError, InputError
from .precision import check_precision, round_to_precision
from .rwlock import ReadWriteLock
from .sample_shapes import check_outputs
from .types import Feed, Feeds, Shape

if TYPE_CHECKING:
    from .parameter import Parameter
    from .sample_shapes import Specializations


class Spec:
    """What flows along an edge, per row: the shape without the leading axis, the kind of data
    ('float' = the network's float type, 'int32', or 'selection': a lamina.Selection fed as it
    is), and whether the rows are the steps of a sequence batch (leading axis = total steps,
    offsets alongside) or one per sample. A `selected` value holds one float per entry of the
    batch's selection (a selective layer's output): its length varies from batch to batch, so
    the layer that writes it sizes it (Context.selected_output)."""

    __slots__ = ("shape", "kind", "sequence", "selected")

    def __init__(self, shape, kind="float", sequence=False, selected=False):
        self.shape = tuple(int(s) for s in shape)
        self.kind = kind
        self.sequence = bool(sequence)
        self.selected = bool(selected)

    def __eq__(self, other):
        return (isinstance(other, Spec) and self.shape == other.shape and self.kind == other.kind
                and self.sequence == other.sequence and self.selected == other.selected)

    def __repr__(self):
        if self.kind == "selection":
            return "selection"
        prefix = "selected:" if self.selected else ("seq:" if self.sequence else "")
        return f"{prefix}{self.kind}{list(self.shape)}"


class Value:
    """A named edge of the graph: a network input or a node's output."""

    def __init__(self, network, name, producer=None, spec=None):
        # weakly: a network holds its values, so a strong reference back would make every
        # network a reference cycle that only the cycle collector frees (with all its buffers)
        self._network = weakref.ref(network)
        self.name, self.producer, self.spec = name, producer, spec
        self._requires_grad = False

    @property
    def network(self):
        net = self._network()
        if net is None:
            raise GraphError(f"value '{self.name}': its network no longer exists")
        return net

    @property
    def requires_grad(self):
        """For inputs: whether backward computes their gradient (read it with net.grad(name))."""
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, flag):
        if self.producer is not None:
            raise GraphError(f"'{self.name}': requires_grad is set on inputs; a layer's output gets a "
                             f"gradient whenever something before it does")
        self._requires_grad = bool(flag)
        self.network._invalidate()

    def __repr__(self):
        return f"Value({self.name!r}, {self.spec})"


class Node:
    """One application of a layer to input values; a layer applied twice is two nodes that share
    the layer's parameters. Its outputs are named after the node: the first is the node's name,
    the others '<node>.<label>' (e.g. 'lstm0.last')."""

    def __init__(self, name, layer, inputs):
        self.name, self.layer, self.input_names = name, layer, list(inputs)
        self.outputs = [name if not label else f"{name}.{label}" for label in layer.output_labels]
        self.output = self.outputs[0]
        self.inputs = None  # resolved Values

    def __repr__(self):
        return f"Node({self.name!r}, {type(self.layer).__name__})"

    def describe(self):
        return f"layer '{self.name}' ({type(self.layer).__name__})"


class _NodeArg:
    """An input or output described as ONNX Runtime's NodeArg is: name, shape, type."""

    def __init__(self, name, spec, dynamic=None):
        self.name = name
        dynamic = dynamic or {}
        self.shape = (["N"] + (["T"] if spec.sequence else [])
                      + [dynamic.get(i, size) for i, size in enumerate(spec.shape or ())])
        self.type = {"float": "tensor(float)", "int32": "tensor(int32)"}.get(spec.kind, spec.kind)

    def __repr__(self):
        return f"NodeArg(name={self.name!r}, type={self.type!r}, shape={self.shape})"


class Network:
    """A DAG of layers. Build with `input`, layer calls (or `add`) and `outputs`; run with
    `run` (inference), `train_step`, or `forward` + `backward`."""

    # set on a network imported from ONNX (lamina.onnx.load): each input's and output's ONNX
    # axes, the ONNX inputs that held sequence lengths, and the lengths a model fixes (or None)
    onnx_axes: dict[str, tuple]
    onnx_lengths: list[str]
    onnx_constant_lengths: Optional[np.ndarray]

    def __init__(self, dtype: Any = "float32", backend: Any = None) -> None:
        from .threads import check_environment
        check_environment()
        self.dtype = np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"Network: dtype must be float32 or float64, found {self.dtype}")
        # how inference multiplies by the weights (lamina.precision), and training (autocast)
        self.precision = "float32"
        self.training_precision = "float32"
        if backend is None:  # the CPU's, resolved here: the graph module imports no backend
            from .backends import get_backend
            backend = get_backend("cpu")
        self.backend = backend
        self.values: dict[str, Value] = {}  # name -> Value (inputs and node outputs)
        self.input_names: list[str] = []
        self.nodes: list[Node] = []
        self.output_values: dict[str, str] = {}  # output name -> value name
        self.rng = np.random.default_rng(0)  # dropout masks; seed with `seed`
        # data a model needs to be used (a vocabulary, normalisation constants): JSON-able values
        # or numpy arrays, saved in the model file beside the parameters
        self.assets: dict[str, Any] = {}
        self._layer_uses: dict[int, int] = {}
        self._layer_names: set[str] = set()  # of the layers applied so far
        self._next_of_kind: dict[str, int] = {}  # kind -> the index a fresh name of that kind tries first
        self._scheduler = None
        # inputs whose sample shape a batch sets: name -> {sample axis: its symbol}; such a
        # network runs each batch on a network made for the batch's shapes (lamina.sample_shapes)
        self.dynamic_axes: dict[str, dict[int, str]] = {}
        self._specializations: Optional[Specializations] = None  # where dynamic_axes is set
        # the network made for other sample shapes that the last forward ran on (backward
        # continues there); None: this one (no reference to itself, so a dropped network is
        # freed without the cycle collector)
        self._forwarded: Optional[Network] = None
        # `run` may be called from many threads at once (each run gets buffers of its own);
        # training, moves and type changes wait for the runs in flight and run alone
        self._lock = ReadWriteLock()
        self._scheduler_lock = threading.Lock()

    # ------------------------------------------------------------------ building
    def input(self, name: str, shape: Shape = (), dtype: str = "float", sequence: bool = False,
              dynamic: Any = None) -> Value:
        """Declare an input; `shape` is per row (no batch axis); dtype 'float' (the network's
        float type), 'int32' (labels, ids) or 'selection' (the columns a selective layer scores,
        fed as a lamina.Selection; no shape); sequence=True for variable-length sequence batches
        (fed as lamina.Sequences). `dynamic`: the axes of `shape` a batch may size otherwise
        (images of any height and width: shape=(3, 224, 224), dynamic=(1, 2)), `shape` giving
        their example size; each batch then runs at its own shape (lamina.sample_shapes)."""
        if dtype not in ("float", "int32", "selection"):
            raise ValueError(f"input '{name}': dtype must be 'float', 'int32' or 'selection', found {dtype!r}")
        if dtype == "selection" and (shape not in ((), [], None) or sequence):
            raise ValueError(f"input '{name}': a selection input takes no shape and is not a sequence")
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if any(int(s) < 1 for s in shape):
            raise ValueError(f"input '{name}': every dimension must be at least 1, found {shape}")
        if dynamic and any(not 0 <= int(a) < len(shape) for a in dynamic):
            raise ValueError(f"input '{name}': dynamic axes {sorted(map(int, dynamic))} are not among the "
                             f"{len(shape)} axes of its shape {shape}")
        self._claim(name, f"input '{name}'")
        value = Value(self, name, None, Spec(shape, dtype, sequence))
        self.values[name] = value
        self.input_names.append(name)
        if dynamic:
            self._declare_dynamic(name, dynamic)
        self._invalidate()
        return value

    def add(self, layer: Any, inputs: Any, name: Optional[str] = None) -> Any:
        """Apply `layer` to `inputs` (Values or value names); returns the output Value."""
        inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        names = []
        for i, v in enumerate(inputs):
            if isinstance(v, Value):
                if v.network is not self:
                    raise GraphError(f"{type(layer).__name__}: input {i} '{v.name}' belongs to another network")
                names.append(v.name)
            elif isinstance(v, str):
                names.append(v)
            else:
                raise GraphError(f"{type(layer).__name__}: input {i} must be a Value or a value name, "
                                 f"found {type(v).__name__}")
        uses = self._layer_uses.get(id(layer), 0)
        if layer.name is None:
            layer.name = self.fresh_name(layer.kind)
        self._layer_names.add(layer.name)
        node_name = name or (layer.name if uses == 0 else f"{layer.name}#{uses}")
        self._claim(node_name, f"layer '{node_name}'")
        self._layer_uses[id(layer)] = uses + 1
        node = Node(node_name, layer, names)
        for out in node.outputs[1:]:
            self._claim(out, f"layer '{node_name}' output")
        layer.bind_parameters()
        for out in node.outputs:
            self.values[out] = Value(self, out, node)
        if all(n in self.values and self.values[n].spec is not None for n in names):
            # everything it reads exists: check it now, so a mistake shows at the line that made it
            node.inputs = [self.values[n] for n in names]
            try:
                self._infer(node)
            except GraphError:
                for out in node.outputs:
                    del self.values[out]
                self._layer_uses[id(layer)] = uses
                raise
        self.nodes.append(node)
        self._invalidate()
        outs = tuple(self.values[o] for o in node.outputs)
        return outs[0] if len(outs) == 1 else outs

    def outputs(self, *values: Union[Value, str], **named: Union[Value, str]) -> Network:
        """Name the network's outputs: `outputs(loss=l, logits=y)` or `outputs(y)` (named after the
        value). Cost-layer outputs among them are what `backward` minimises."""
        for v in values:
            named[v.name if isinstance(v, Value) else v] = v
        for out_name, v in named.items():
            self.output_values[out_name] = v.name if isinstance(v, Value) else v
        self._invalidate()
        return self

    def seed(self, seed: Any) -> None:
        """Seed the generator behind dropout masks."""
        self.rng = np.random.default_rng(seed)

    def _claim(self, name, what):
        if not isinstance(name, str) or not name:
            raise GraphError(f"{what}: a name must be a non-empty string, found {name!r}")
        if name in self.values:
            raise GraphError(f"{what}: the name '{name}' is already used in this network")

    def fresh_name(self, kind: str) -> str:
        """'<kind><i>' for the first i that names no layer or value, counting on from the last
        name given to this kind (so n layers get their names in O(n), not O(n^2))."""
        i = self._next_of_kind.get(kind, 0)
        while f"{kind}{i}" in self._layer_names or f"{kind}{i}" in self.values:
            i += 1
        self._next_of_kind[kind] = i + 1
        return f"{kind}{i}"

    def _invalidate(self):
        self._scheduler = None
        self._forwarded = None
        if self._specializations is not None:
            self._specializations.clear()

    # ------------------------------------------------------------------ dynamic sample axes
    def set_dynamic_axes(self, axes: Mapping[str, Mapping[int, str]], make: Callable[[dict], Network]) -> None:
        """Let batches set the size of some inputs' sample axes where the network as built so far
        is made by make({input: sample shape}) (the ONNX importer's: it imports the model again
        at those shapes; lamina.sample_shapes). `axes` maps an input to {sample axis: its symbol}.
        Layers added later are added to each made network as they are."""
        from .sample_shapes import Specializations
        self._check_dynamic(axes)
        self.dynamic_axes = {name: {int(a): str(s) for a, s in dims.items()} for name, dims in axes.items() if dims}
        self._specializations = Specializations(make, len(self.input_names), len(self.nodes))

    def _check_dynamic(self, axes):
        for name, dims in axes.items():
            if name not in self.input_names:
                raise GraphError(f"dynamic axes name '{name}', which is no input of this network")
            rank = len(self.values[name].spec.shape)
            if any(not 0 <= int(a) < rank for a in dims):
                raise GraphError(f"input '{name}': dynamic axes {sorted(map(int, dims))} are not among its "
                                 f"{rank} sample axes")

    def _declare_dynamic(self, name, dynamic):
        """Network.input's `dynamic`: axes, or {axis: symbol}."""
        from .sample_shapes import Specializations
        dims = dict(dynamic) if isinstance(dynamic, Mapping) else {int(a): f"{name}_{int(a)}" for a in dynamic}
        self._check_dynamic({name: dims})
        if dims:
            self.dynamic_axes[name] = {int(a): str(s) for a, s in dims.items()}
            if self._specializations is None:
                self._specializations = Specializations()

    def declared_dynamic_axes(self) -> dict[str, dict[int, str]]:
        """The dynamic axes a model file keeps: those declared with `input(..., dynamic=)` (an
        imported model's own stay with the import, which alone can make it at other shapes)."""
        return self._specializations.declared(self) if self._specializations is not None else {}

    def for_sample_shapes(self, shapes: Mapping[str, Sequence[int]]) -> Network:
        """The network that runs batches of these sample shapes ({input: shape without the batch
        axis}): this one at its own shapes, else the one made for them (sharing this network's
        parameters). `run`, `forward` and `train_step` pick it by themselves."""
        feeds = {name: np.empty((0, *map(int, shape)), np.float32) for name, shape in shapes.items()}
        net = self._for_feeds(feeds)
        if net is self and any(tuple(self.values[n].spec.shape) != tuple(s) for n, s in shapes.items()
                               if n in self.values):
            raise InputError(f"sample shapes {dict(shapes)}: this network takes "
                             f"{ {n: self.values[n].spec.shape for n in self.input_names} } "
                             f"(dynamic axes: {self.dynamic_axes or 'none'})")
        return net

    def _for_feeds(self, feeds: Any) -> Network:
        """The network that runs this batch: this one, or the one made for its sample shapes."""
        made = self._specializations
        if made is None or not isinstance(feeds, Mapping):
            return self
        shapes = made.shapes_for(self, feeds)
        return self if shapes is None else made.get(self, shapes)

    # ------------------------------------------------------------------ inspection
    @property
    def layers(self):
        """Distinct layers in the order they were added."""
        seen = {}
        for n in self.nodes:
            seen.setdefault(id(n.layer), n.layer)
        return list(seen.values())

    def named_parameters(self) -> list[tuple[str, Parameter]]:
        """(name, Parameter) for every distinct parameter, in layer order."""
        seen = {}
        for layer in self.layers:
            for pname, p in layer.params.items():
                if id(p) not in seen:
                    seen[id(p)] = (p.name or f"{layer.name}.{pname}", p)
        return list(seen.values())

    def parameters(self) -> list[Parameter]:
        return [p for _, p in self.named_parameters()]

    def layer(self, name: str) -> Any:
        for layer in self.layers:
            if layer.name == name:
                return layer
        raise KeyError(f"no layer named '{name}'; layers: {', '.join(l.name for l in self.layers)}")

    def freeze(self, *names: str, frozen: bool = True) -> None:
        """Freeze (or with frozen=False, unfreeze) layers or parameters by name: no gradient, no update."""
        with self._lock.write():
            self._freeze(names, frozen)

    def _freeze(self, names, frozen):
        params = dict(self.named_parameters())
        for name in names:
            if name in params:
                params[name].frozen = frozen
            else:
                for p in self.layer(name).params.values():
                    p.frozen = frozen
        self._invalidate()

    def to(self, device: Any) -> Network:
        """Place the network on a device: 'cpu', 'opencl', 'opencl:N' or a backend object. Its
        parameters and their optimizer state move along; every layer must run there (a layer
        that cannot is named in the error)."""
        from .backends import get_backend
        backend = get_backend(device)
        with self._lock.write():
            return self._to(backend)

    def _to(self, backend):
        if not backend.host_arrays:
            cannot = [f"'{l.name}' ({type(l).__name__})" for l in self.layers if l.needs_host_arrays]
            if cannot:
                which = f"layer {cannot[0]} calls" if len(cannot) == 1 else f"layers {', '.join(cannot)} call"
                raise GraphError(f"cannot place the network on {backend}: {which} numpy on its arrays "
                                 f"(needs_host_arrays), and this backend's arrays are not numpy arrays")
        for p in self.parameters():
            p.move(backend)
        self.backend = backend
        self._invalidate()
        return self

    def astype(self, dtype: Any) -> Network:
        """Convert every parameter to dtype (float64 for gradient checks; inputs follow), or, with
        'bfloat16', make inference multiply by the weights in bfloat16 (set_precision)."""
        if isinstance(dtype, str) and dtype in ("bfloat16", "bf16"):
            return self.set_precision("bfloat16")
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            dtype = None
        if dtype not in (np.float32, np.float64):
            raise ValueError(f"astype: lamina computes in float32 or float64, found {dtype}; float16 is a storage "
                             f"type only (lm.save(net, path, half=True)), and reduced-precision inference is "
                             f"astype('bfloat16') or lm.quantize(net)")
        with self._lock.write():
            self.dtype = np.dtype(dtype)
            self.precision = "float32"
            for p in self.parameters():
                p.astype(self.dtype)
            self._invalidate()
        return self

    def set_precision(self, precision: str) -> Network:
        """Make inference multiply by the weights in `precision` (lamina.precision): every layer's
        product weights (Layer.product_weights) take the values they have in it (rounded to
        bfloat16, or int8 per output channel times its scale, still held as float32), and their
        packs are made in it when first used. Training multiplies in the training precision
        (autocast), from these values; a model file stores these weights in the precision.
        'float32' only marks the network: rounded weights stay as they are."""
        check_precision(precision, "set_precision")
        with self._lock.write():
            self._require_float32(f"set_precision({precision!r})", precision)
            weights = {id(p): p for layer in self.layers for p in map(layer.params.get, layer.product_weights())}
            for p in weights.values():  # (each once: a tied weight is rounded once)
                p.assign(round_to_precision(p.value, precision))
            self.precision = precision
            self._invalidate()
        return self

    def _require_float32(self, where: str, precision: str) -> None:
        """A reduced precision rounds float32 values: refused for a network of another dtype."""
        if precision != "float32" and self.dtype != np.float32:
            raise ValueError(f"{where}: the network must be float32, found {self.dtype}")

    def autocast(self, precision: str = "bfloat16") -> Network:
        """Make training multiply in `precision` ('bfloat16', or 'float32' to undo): the products
        of Linear layers and of the recurrent layers (input, recurrent and gradient products) take
        both operands rounded to bfloat16 and sum in float32, forward and backward; the
        parameters stay float32 (the optimizer's master weights) and so do activations, states,
        gradients and the other layers. No loss scaling: bfloat16 has float32's range."""
        if precision not in ("float32", "bfloat16"):
            raise ValueError(f"autocast: precision must be 'bfloat16' or 'float32', found {precision!r}")
        with self._lock.write():
            self._require_float32(f"autocast({precision!r})", precision)
            self.training_precision = precision
            self._invalidate()
        return self

    # ------------------------------------------------------------------ validation
    def validate(self) -> list[Node]:
        """Resolve names, order the nodes topologically and infer every shape; returns the order."""
        if not self.output_values:
            raise GraphError("network has no outputs: call net.outputs(...)")
        for node in self.nodes:
            node.inputs = []
            for i, vname in enumerate(node.input_names):
                if vname not in self.values:
                    raise GraphError(f"{node.describe()}: input {i} '{vname}' is not a value of this "
                                     f"network (values: {', '.join(self.values)})")
                node.inputs.append(self.values[vname])
        for out_name, vname in self.output_values.items():
            if vname not in self.values:
                raise GraphError(f"output '{out_name}' refers to '{vname}', which is not a value of this network")
        order = self._topological_order()
        for node in order:
            self._infer(node)
        return order

    def _infer(self, node):
        """Check a node's inputs and set its output spec; errors name the layer."""
        try:
            specs = node.layer.check_inputs([v.spec for v in node.inputs])
        except (ValueError, TypeError) as e:
            got = ", ".join(f"'{v.name}' {v.spec}" for v in node.inputs)
            raise GraphError(f"{node.describe()}: {e} (inputs: {got})") from None
        specs = specs if isinstance(specs, tuple) else (specs,)
        for out, spec in zip(node.outputs, specs):
            self.values[out].spec = spec

    def _topological_order(self):
        """Kahn's algorithm, stable in insertion order; a cycle is reported by its nodes."""
        producer = {out: n for n in self.nodes for out in n.outputs}
        pending = {n.name: sum(1 for v in n.inputs if v.name in producer) for n in self.nodes}
        consumers = {n.name: [] for n in self.nodes}
        for n in self.nodes:
            for v in n.inputs:
                if v.name in producer:
                    consumers[producer[v.name].name].append(n)
        ready = [n for n in self.nodes if pending[n.name] == 0]
        order = []
        while ready:
            node = ready.pop(0)
            order.append(node)
            for c in consumers[node.name]:
                pending[c.name] -= 1
                if pending[c.name] == 0:
                    ready.append(c)
        if len(order) != len(self.nodes):
            stuck = [n.name for n in self.nodes if pending[n.name] > 0]
            raise GraphError(f"the network has a cycle through layers {', '.join(stuck)}")
        return order

    # ------------------------------------------------------------------ running
    @property
    def scheduler(self):
        scheduler = self._scheduler
        if scheduler is None:
            from .scheduler import Scheduler
            with self._scheduler_lock:
                if self._scheduler is None:
                    self._scheduler = Scheduler(self, self.validate())
                scheduler = self._scheduler
        return scheduler

    def run(self, feeds: Any, outputs: Any = None, consume: Optional[Callable[[dict], Any]] = None) -> Any:
        """Inference: returns {output name: numpy array} (arrays of their own, safe to keep:
        on the CPU the buffers the layers wrote, the next run writing elsewhere). Safe to call
        from several threads at once on one network. With `consume`, the outputs are not
        copied: consume(outputs) gets views of the network's buffers, valid only during that
        call, and run returns what it returns (a server encodes its responses from them).

        ONNX Runtime's form works too: run(None or [output names], {input: array}) returns a
        list of arrays in the order asked (None: every output its inputs compute)."""
        if (feeds is None or isinstance(feeds, (list, tuple))) and isinstance(outputs, dict):
            net = self._for_feeds(outputs)
            if net is not self:
                check_outputs(net, feeds, self)
                return net.run(feeds, outputs)
            names = list(feeds) if feeds is not None else None
            with self._lock.read():
                got = self.scheduler.run(outputs, names)
            return [got[n] for n in (names or got)]
        if not isinstance(feeds, dict):
            raise InputError(f"run takes a dict of input name -> array (run({{'{self._first_input()}': x}})), "
                             f"or ONNX Runtime's run(None, {{...}}); found {type(feeds).__name__}")
        net = self._for_feeds(feeds)
        if net is not self:
            check_outputs(net, outputs, self)
            return net.run(feeds, outputs, consume)
        with self._lock.read():
            return self.scheduler.run(feeds, outputs, consume)

    def _first_input(self):
        return self.input_names[0] if self.input_names else "x"

    def __call__(self, *arrays: Feed, **named: Feed) -> Any:
        """PyTorch's habit, model(x): the arrays fed to the inputs in their order (and by name);
        returns the one output computed, or a dict of them. net.run is the full form."""
        if len(arrays) > len(self.input_names):
            raise InputError(f"this network takes {len(self.input_names)} input(s) "
                             f"({', '.join(self.input_names)}), found {len(arrays)} positional arrays")
        feeds = dict(zip(self.input_names, arrays))
        clash = sorted(set(feeds) & set(named))
        if clash:
            raise InputError(f"input '{clash[0]}' is given both by position and by name")
        out = self.run({**feeds, **named})
        return next(iter(out.values())) if len(out) == 1 else out

    def eval(self) -> Network:
        """PyTorch's model.eval(): lamina's `run` is always inference (dropout off, batch
        statistics fixed) and `train_step` always training, so there is no mode to set."""
        return self

    def train(self, mode: bool = True) -> Network:
        """PyTorch's model.train() sets a mode; lamina has none to set (see `eval`). Training is
        net.train_step(feeds, optimizer)."""
        if mode:
            raise GraphError("lamina networks have no training mode to switch on: train with "
                             "net.train_step(feeds, optimizer) (lamina.optim), and run inference with net.run")
        return self

    def get_inputs(self) -> list[_NodeArg]:
        """ONNX Runtime's session.get_inputs(): each input's name, shape (the batch axis first, as
        'N'; a sequence's steps as 'T') and type."""
        return [_NodeArg(name, self.values[name].spec, self.dynamic_axes.get(name)) for name in self.input_names]

    def get_outputs(self) -> list[_NodeArg]:
        """ONNX Runtime's session.get_outputs() (see get_inputs)."""
        return [_NodeArg(o, self.values[v].spec) for o, v in self.output_values.items()]

    def forward(self, feeds: Feeds, training: bool = True, grad_outputs: Sequence[str] = (),
                outputs: Optional[Sequence[str]] = None) -> dict[str, Any]:
        """Forward pass keeping every activation for `backward`; returns {output: array view}
        (valid until the next forward) for `outputs` (default: all). `grad_outputs` names
        outputs whose gradients the caller will pass to backward instead of starting from the
        costs."""
        net = self._for_feeds(feeds)
        self._forwarded = net if net is not self else None
        if net is not self:
            check_outputs(net, list(outputs or self.output_values) + list(grad_outputs), self)
            return net.forward(feeds, training, grad_outputs, outputs)
        with self._lock.write():
            return self.scheduler.forward(feeds, training, grad_outputs, outputs)

    def backward(self, on_ready: Optional[Callable[[Parameter], None]] = None,
                 grad_outputs: Optional[Mapping[str, np.ndarray]] = None) -> Optional[float]:
        """Backward from every cost output (each averaged over its rows), or from the gradients
        in `grad_outputs` ({output: array}) when forward declared them. Parameter gradients
        accumulate until an optimizer consumes them; `on_ready(param)` fires once per parameter
        as soon as its last user has finished backward. Returns the loss (None with grad_outputs)."""
        net = self._forwarded
        if net is not None and net is not self:
            return net.backward(on_ready, grad_outputs)
        with self._lock.write():
            return self.scheduler.backward(on_ready, grad_outputs)

    def train_step(self, feeds: Feeds, optimizer: Any) -> float:
        """forward + backward with per-parameter updates as gradients complete; returns the loss
        (of the weights before the update). Only the costs are computed (and what they need).
        A non-finite loss or gradient skips the step or raises, as the optimizer's `nonfinite`
        says (see lamina.optim); `optimizer.last_step_skipped` tells."""
        net = self._for_feeds(feeds)
        if net is not self:
            check_outputs(net, self.cost_outputs(), self)
            self._forwarded = net
            return net.train_step(feeds, optimizer)
        with self._lock.write():
            self.forward(feeds, training=True, outputs=self.cost_outputs())
            optimizer.begin_step()
            loss = self.scheduler.backward(on_ready=optimizer.update, check_loss=optimizer.check_loss,
                                           sum_over_processes=optimizer.sum_over_processes)
            optimizer.end_step()
        return loss

    def idle_step(self, optimizer: Any) -> float:
        """The training step of a data-parallel rank whose share of the global batch is empty:
        it joins the sum of the losses and every gradient exchange with nothing (zero
        gradients, in the order backward would complete them) and applies the same updates as
        the other ranks. Returns the global batch's loss."""
        with self._lock.write():
            plan = self.scheduler.plan(True, tuple(self.cost_outputs()))
            optimizer.begin_step()
            loss = self.scheduler.backward_without_samples(plan, optimizer.update, optimizer.check_loss,
                                                           optimizer.sum_over_processes)
            optimizer.end_step()
        return loss

    def cost_outputs(self) -> list[str]:
        """The names of the outputs that cost layers produce (what training minimises)."""
        producer = {out: n for n in self.scheduler.order for out in n.outputs}
        return [o for o, v in self.output_values.items() if v in producer and producer[v].layer.is_cost]

    def grad(self, name: str) -> Any:
        """The gradient of a value (an input with requires_grad, or a node output) after backward."""
        net = self._forwarded
        if net is not None and net is not self:
            return net.grad(name)
        return self.scheduler.grad(name)

    def zero_grad(self) -> None:
        """Drop unconsumed parameter gradients, so the next backward overwrites them."""
        for p in self.parameters():
            p.drop_grad()

    def summary(self) -> str:
        order = self.validate()
        rows = [(v, "input", str(self.values[v].spec), "0") for v in self.input_names]
        counted: set[int] = set()  # a shared parameter counts at its first layer; later ones name it
        for n in order:
            own = [p for p in n.layer.params.values() if id(p) not in counted]
            shared = [p.name for p in n.layer.params.values() if id(p) in counted]
            counted.update(id(p) for p in own)
            size = str(sum(p.size for p in own)) + (f" (+ {', '.join(shared)})" if shared else "")
            rows.append((n.name, type(n.layer).__name__, str(self.values[n.output].spec), size))
            rows += [(out, "", str(self.values[out].spec), "") for out in n.outputs[1:]]
        rows.insert(0, ("layer", "type", "output", "params"))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        total = sum(p.size for p in self.parameters())
        lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
        return "\n".join(lines + [f"{total} parameters"])
