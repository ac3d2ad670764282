"""Dynamic batching: the requests for one model queue, and a batch closes when it holds
`max_batch_size` requests or `max_delay` seconds after its first request arrived, whichever comes
first. With max_delay 0 (the default) a batch starts as soon as the model is free and takes what
queued while the last one ran: a lone request waits for nothing, and under load batches grow
by themselves. Requests that feed the same inputs and want the same outputs run together; sequences
join one packed batch (lamina.Sequences: no padding), other inputs stack on the first axis. Each
request gets its own rows of every output.

One batch runs at a time per model, in a thread of the model's own (the kernels release the
GIL, so the event loop goes on taking requests); the network's inference buffers are reused from
batch to batch. A batch that fails on a request's input (an id out of range) runs again one
request at a time, so only that request gets the error.

The work is bounded twice: each request by the protocol's Limits (steps, rows, values), and each
batch by `max_batch_bytes`, the network's buffers for it as the scheduler plans them: a batch
closes before a request that would take it past that, and a request that alone would is refused
(413). A request whose client has gone (hung up, or its deadline passed) leaves the queue at once.
"""
import asyncio
import collections
import concurrent.futures
import math
import time

import numpy as np

from ..errors import GraphError, InputError
from ..sequence import SequenceError, Sequences
from .extensions import Statistics
from .protocol import Limits, ProtocolError, encode_response

USER_ERRORS = (InputError, GraphError, SequenceError, ValueError)


class Pending:
    """One request waiting for its batch: its inputs, the outputs it wants (and which of them
    in binary), its id, and the future of its encoded response."""

    __slots__ = ("arrays", "outputs", "binary", "request_id", "key", "rows", "steps", "future", "arrived",
                 "abandoned", "classes", "padded_to", "net")

    def __init__(self, arrays, outputs, binary, request_id, rows, steps, future, classes=None, padded_to=None,
                 net=None):
        self.classes = classes or {}  # output -> k: answered as its k best classes
        self.padded_to = padded_to  # a request of padded sequences: their T, to pad its sequence outputs to
        self.arrays, self.outputs, self.rows, self.future = arrays, outputs, rows, future
        self.steps = steps  # its sequences' steps in all (None: no sequences)
        self.binary, self.request_id = binary, request_id
        self.net = net  # the network for its sample shapes (the served one, or one made for them)
        # requests batch together where they feed the same inputs, ask the same outputs and have
        # the same sample shapes (an input's dynamic axes: Network.dynamic_axes)
        self.key = (tuple(sorted(arrays)), tuple(outputs), id(net))
        self.arrived = time.perf_counter()
        self.abandoned = False  # its caller stopped waiting (deadline, or hung up): skip it


class ServedModel:
    """A network behind the server: what it can be fed over the protocol, and its batcher."""

    def __init__(self, name, net, max_batch_size=32, max_delay=0.0, max_queue=1024, metrics=None, limits=None,
                 max_batch_bytes=512 << 20):
        self.name, self.net = name, net
        self.max_batch_size, self.max_delay, self.max_queue = int(max_batch_size), float(max_delay), int(max_queue)
        self.limits = limits or Limits()
        self.max_batch_bytes = int(max_batch_bytes)
        # served: the outputs that are not training costs and need no selection (a per-batch
        # choice of sampled columns, not something a client sends)
        feedable = {v for v in net.input_names if net.values[v].spec.kind != "selection"}
        costs = set(net.cost_outputs())
        self.reads = {}  # output -> the inputs it needs, in the network's order
        for o in net.output_values:
            needs = set(net.scheduler.plan(False, (o,)).inputs)
            if o not in costs and needs <= feedable:
                self.reads[o] = [v for v in net.input_names if v in needs]
        self.outputs = list(self.reads)
        if not self.outputs:
            raise ValueError(f"model '{name}': no output to serve (every output is a cost or needs a selection)")
        needed = {v for o in self.outputs for v in self.reads[o]}
        self.inputs = [v for v in net.input_names if v in needed]
        self.sequence_model = any(net.values[v].spec.sequence for v in self.inputs)
        self.optional = initial_states(net, self.inputs)
        self.metrics = metrics
        self.stats = Statistics()
        self._waiting = collections.deque()
        self._arrived = None
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"lamina-{name}")
        self._task = None
        self.running = 0  # requests in the batch being computed

    @property
    def queued(self):
        """Requests waiting for a batch."""
        return len(self._waiting)

    # ------------------------------------------------------------------ the event loop's side
    def start(self):
        self._arrived = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._batches())

    async def stop(self):
        """Finish what is queued and running, then stop."""
        while self._waiting or self.running:
            await asyncio.sleep(0.01)
        if self._task is not None:
            self._task.cancel()
        self._thread.shutdown(wait=True)

    def default_outputs(self, names):
        """The outputs the given inputs compute (an initial state left out counts as given:
        it is zeros)."""
        have = set(names) | set(self.optional)
        outs = [o for o in self.outputs if set(self.reads[o]) <= have]
        if not outs:
            raise ProtocolError(f"no output can be computed from inputs {sorted(names)}; the model's inputs are "
                                f"{', '.join(repr(n) for n in self.inputs)}")
        return outs

    def submit(self, arrays, outputs, binary=(), request_id=None, classes=None):
        """Queue one request; returns its Pending, whose future gets (body, headers) of the
        response (protocol.encode_response) or the exception that refused it. A sequence input
        is one sequence's steps, or a list of several sequences' steps (protocol.sequences_of):
        then every other input holds a row per sequence and the answer's sequence outputs are
        padded to the longest (the request's T: `padded_to`)."""
        needed = {v for o in outputs for v in self.reads[o]}
        arrays = {k: v for k, v in arrays.items() if k in needed}
        sequences = {k: v if isinstance(v, list) else [v] for k, v in arrays.items()
                     if self.net.values[k].spec.sequence}
        padded = any(isinstance(v, list) for v in arrays.values())
        # a request to a sequence model is one sequence or several, one row of every other input each
        rows = (len(next(iter(sequences.values()))) if sequences else 1) if self.sequence_model else \
            next(iter(arrays.values())).shape[0] if arrays else 1
        for name in self.optional:  # an initial state left out: zeros, as in PyTorch
            if name in needed and name not in arrays:
                arrays[name] = np.zeros((rows, *self.net.values[name].spec.shape), np.float32)
        missing = [v for v in self.inputs if v in needed and v not in arrays]
        if missing:
            raise ProtocolError(f"missing input '{missing[0]}' (needed for output(s) {', '.join(outputs)})")
        if len(self._waiting) >= self.max_queue:
            raise ProtocolError(f"model '{self.name}' has {self.queued} requests queued, its limit", 503)
        net = self._network_for(arrays)
        counts = {k: v.shape[0] for k, v in arrays.items() if not self.net.values[k].spec.sequence}
        if len(set(counts.values())) > 1:
            raise ProtocolError(f"the inputs hold different numbers of rows: {counts}")
        lengths = [len(s) for s in next(iter(sequences.values()))] if sequences else None
        steps = sum(lengths) if lengths else None
        padded_to = max(lengths) if padded else None
        specs = {o: net.values[net.output_values[o]].spec for o in outputs}
        self.limits.check_outputs({o: ((rows * padded_to if padded else steps) if spec.sequence else rows)
                                   * math.prod(spec.shape) for o, spec in specs.items()})
        nbytes = net.scheduler.inference_bytes(outputs, rows, steps)
        if nbytes > self.max_batch_bytes:
            raise ProtocolError(f"this request alone needs {nbytes / 2 ** 20:.1f} MiB of buffers in model "
                                f"'{self.name}'; a batch may take {self.max_batch_bytes / 2 ** 20:g} MiB "
                                f"(--max-batch-mb)", 413)
        pending = Pending({**arrays, **sequences}, outputs, binary, request_id, rows, steps,
                          asyncio.get_running_loop().create_future(), classes, padded_to, net)
        self._waiting.append(pending)
        self._arrived.set()
        return pending

    async def prepare(self, arrays):
        """Make the network for a request's sample shapes (where an input's axes are dynamic) in
        the model's thread before `submit`: an ONNX model's import at a new size takes a while,
        and the event loop goes on serving meanwhile."""
        if self.net.dynamic_axes:
            await asyncio.get_running_loop().run_in_executor(self._thread, self._network_for, arrays)

    def _network_for(self, arrays):
        """The network for these sample shapes (the served one, or one made for them)."""
        try:
            return self.net.for_sample_shapes({k: arrays[k].shape[1:] for k in self.net.dynamic_axes
                                               if isinstance(arrays.get(k), np.ndarray)
                                               and not self.net.values[k].spec.sequence})
        except (InputError, GraphError) as e:  # a size the network's layers cannot take
            raise ProtocolError(str(e), 400) from None

    def abandon(self, pending):
        """The request's client is gone: it leaves the queue (a batch already running it
        finishes, and its answer is dropped)."""
        pending.abandoned = True
        try:
            self._waiting.remove(pending)
        except ValueError:
            pass  # already taken into a batch

    async def _batches(self):
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting:
                self._arrived.clear()
                await self._arrived.wait()
            first = self._waiting[0]
            close = first.arrived + self.max_delay
            while self._rows_like(first) < self.max_batch_size and time.perf_counter() < close:
                self._arrived.clear()
                try:
                    await asyncio.wait_for(self._arrived.wait(), close - time.perf_counter())
                except TimeoutError:
                    break
            batch = self._take(first.key)
            if not batch:
                continue
            self.running = len(batch)
            start = time.perf_counter()
            if self.metrics:
                for p in batch:
                    self.metrics.queue_seconds.labels(self.name).observe(start - p.arrived)
                self.metrics.batch_size.labels(self.name).observe(len(batch))
            try:
                results = await loop.run_in_executor(self._thread, self._run, batch)
            except Exception as e:  # the thread pool itself failed: every request learns it
                results = [e] * len(batch)
            computed = time.perf_counter() - start
            self.stats.batch(len(batch), computed)
            self.stats.add("compute_infer", computed, len(batch))
            self.stats.add("queue", sum(start - p.arrived for p in batch), len(batch))
            if self.metrics:
                self.metrics.compute_seconds.labels(self.name).observe(computed)
            self.running = 0
            for p, result in zip(batch, results):
                if not p.future.done() and not p.abandoned:
                    (p.future.set_exception if isinstance(result, Exception) else p.future.set_result)(result)

    def _rows_like(self, first):
        return sum(p.rows for p in self._waiting if p.key == first.key and not p.abandoned)

    def _take(self, key):
        """The queue's requests of `key` that fit one batch (at most max_batch_size rows and, by
        the scheduler's plan, max_batch_bytes of buffers), in arrival order; the first always."""
        batch, rest, rows, steps = [], collections.deque(), 0, 0
        for p in self._waiting:
            if p.abandoned:
                continue
            if p.key == key and (not batch or self._fits(p, rows + p.rows, None if p.steps is None else steps + p.steps)):
                batch.append(p)
                rows += p.rows
                steps += p.steps or 0
            else:
                rest.append(p)
        self._waiting = rest
        return batch

    def _fits(self, p, rows, steps):
        """Whether a batch of `rows` rows and `steps` steps, p's outputs, is within the limits."""
        return rows <= self.max_batch_size and \
            p.net.scheduler.inference_bytes(p.outputs, rows, steps) <= self.max_batch_bytes


    # ------------------------------------------------------------------ the model's thread
    def _run(self, batch):
        """[response or exception] per request: the batch together, or, when that fails, one
        request at a time, so only the request at fault gets the error."""
        results = self._attempt(batch)
        if not isinstance(results, Exception):
            return results
        if len(batch) == 1:
            return [results]
        return [r for p in batch for r in self._attempt_each(p)]

    def _attempt(self, batch):
        """The batch's responses, or the exception that stopped it (a user's mistake as a
        ProtocolError, a 400)."""
        try:
            return self._run_together(batch)
        except USER_ERRORS as e:
            return ProtocolError(str(e), 400)
        except Exception as e:
            return e

    def _attempt_each(self, p):
        result = self._attempt([p])
        return [result] if isinstance(result, Exception) else result

    def _run_together(self, batch):
        """One run of the batch; each request's response is encoded straight from the
        network's output buffers (no copy of the whole batch's outputs)."""
        net, first = self.net, batch[0]
        feeds = {}
        for name in first.arrays:
            parts = [p.arrays[name] for p in batch]
            if net.values[name].spec.sequence:
                feeds[name] = Sequences.from_list([steps for part in parts for steps in part])
            else:
                feeds[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        bounds = np.cumsum([0] + [p.rows for p in batch])

        def respond(out):
            responses = []
            for i, p in enumerate(batch):
                mine = {}
                for name, value in out.items():
                    if isinstance(value, Sequences):
                        s = value.starts[bounds[i]:bounds[i + 1] + 1]
                        mine[name] = value.values[s[0]:s[-1]] if p.padded_to is None else \
                            padded(value.values, s, p.padded_to)
                    else:
                        mine[name] = value[bounds[i]:bounds[i + 1]]
                responses.append(encode_response(self.name, p.request_id, mine, p.binary, p.classes))
            return responses
        return net.run(feeds, list(first.outputs), consume=respond)


def padded(values, starts, steps):
    """Sequences' steps values[starts[i]:starts[i + 1]] as one [n, steps, ...] array, zeros
    past each sequence's end."""
    out = np.zeros((len(starts) - 1, steps) + values.shape[1:], values.dtype)
    for i in range(len(starts) - 1):
        out[i, :starts[i + 1] - starts[i]] = values[starts[i]:starts[i + 1]]
    return out


def initial_states(net, inputs):
    """The float inputs that only feed recurrent layers' initial states (their inputs after the
    first): a request may leave them out."""
    uses = {}
    for node in net.nodes:
        for slot, v in enumerate(node.inputs):
            uses.setdefault(v.name, []).append((node.layer, slot))
    return [v for v in inputs if uses.get(v) and net.values[v].spec.kind == "float"
            and all(slot in layer.initial_state_slots for layer, slot in uses[v])]

