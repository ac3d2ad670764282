"""Data-parallel training over MPI (mpi4py, with any MPI: the `mpich` wheel, Open MPI, Intel MPI).

Every process (rank) holds the whole network and trains on its own shard of each global batch;
before each parameter's update its gradient is summed over the ranks, so N ranks with B samples
each take exactly the step one process takes with the N·B samples. The costs' means are taken
over the whole global batch (their sums and row counts are summed over the ranks first), so
shards of unequal size (sequences of different lengths) still weigh every row alike.

    import lamina as lm
    from lamina import distributed as dist

    world = dist.init()                       # MPI.COMM_WORLD; world.rank, world.size
    opt = lm.optim.Adam(net, lr=1e-3)
    dist.data_parallel(net, opt)              # rank 0's parameters and optimizer state everywhere
    sampler = dist.ShardedSampler(len(data), 64, world)
    for b in range(len(sampler)):
        index = sampler.indices(epoch, b)     # this rank's share of global batch b
        net.train_step(batch(index), opt)     # returns the loss of the whole global batch

Launched with `mpiexec -n N python script.py` (or `mpiexec -n N lamina train ...`). Gradients
travel while backward goes on: a dense gradient joins a bucket as soon as it is complete and a
full bucket starts a nonblocking allreduce; a sparse gradient (embedding and selective-layer rows)
travels as its rows and their values (allgather, then duplicate rows summed). A thread of the
reducer drives MPI's progress, so transfers advance during the kernels (see reducer.py).

Faults: every wait is bounded (`timeout` seconds): a rank that stops answering makes the others
abort the whole job with a message naming what they waited for; an uncaught exception on any
rank prints its traceback and aborts the job (MPI_Abort), instead of leaving the other ranks
waiting in a collective forever. A killed rank is cleaned up by the launcher.
"""
from __future__ import annotations

import os
import sys
import time
import traceback
from typing import Any, Mapping, Optional

import numpy as np

from ..parameter import host

DEFAULT_TIMEOUT = 300.0  # seconds a rank waits for the others before it aborts the job
DEFAULT_BUCKET_MB = 4.0  # gradient bytes per allreduce (PyTorch DDP: 25 MB, Horovod: 64 MB fused)
ABORT_GRACE = 0.5  # seconds between printing why a rank aborts the job and the abort

# variables the common launchers set in every process they start (MPICH's hydra and Intel MPI:
# PMI_*, Open MPI: OMPI_COMM_WORLD_*, PMIx launchers: PMIX_RANK)
_LAUNCHER_VARIABLES = ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")

_world = None


def launched() -> bool:
    """Whether this process was started by an MPI launcher (mpiexec, mpirun, srun)."""
    return any(v in os.environ for v in _LAUNCHER_VARIABLES)


class World:
    """The ranks of one job: `rank`, `size`, and the few collectives lamina needs, each waited
    for at most `timeout` seconds."""

    def __init__(self, comm: Any, timeout: float = DEFAULT_TIMEOUT) -> None:
        from mpi4py import MPI
        self.MPI, self.comm = MPI, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.timeout = float(timeout)

    def __repr__(self):
        return f"World(rank={self.rank}, size={self.size})"

    def abort(self, message: str, code: int = 1) -> None:
        """Print `message` (naming this rank) and end every rank of the job."""
        print(f"lamina rank {self.rank}/{self.size}: {message}", file=sys.stderr, flush=True)
        # the launcher forwards a rank's output from a pipe, and tears the job down as soon as
        # the abort reaches it (MPICH's hydra does): without this pause the message can be lost
        time.sleep(ABORT_GRACE)
        self.comm.Abort(code)

    def wait(self, requests, what):
        """Wait for nonblocking `requests`; past the timeout, abort the job naming `what`."""
        deadline = time.monotonic() + self.timeout
        pause = 1e-5
        while not self.MPI.Request.Testall(requests):
            if time.monotonic() > deadline:
                self.abort(f"waited {self.timeout:g} s for {what}: another rank stopped or hangs")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)

    def sum(self, values: Any, what: str = "a sum over the ranks") -> np.ndarray:
        """Elementwise sum over the ranks of a float64 vector (every rank gets it)."""
        values = np.array(values, np.float64)
        out = np.empty_like(values)
        self.wait([self.comm.Iallreduce(values, out, op=self.MPI.SUM)], what)
        return out

    def any(self, flag: bool, what: str = "a flag from the ranks") -> bool:
        """Whether `flag` is true on any rank."""
        return bool(self.sum([1.0 if flag else 0.0], what)[0] > 0)

    def broadcast(self, obj: Any, what: str = "rank 0's settings") -> Any:
        """rank 0's `obj` (small, JSON-like data) on every rank."""
        data = np.frombuffer(repr(obj).encode() if self.rank == 0 else b"", np.uint8)
        size = np.array([len(data)], np.int64)
        self.wait([self.comm.Ibcast(size, root=0)], what)
        buf = np.empty(int(size[0]), np.uint8)
        if self.rank == 0:
            buf[:] = data
        self.wait([self.comm.Ibcast(buf, root=0)], what)
        import ast
        return ast.literal_eval(buf.tobytes().decode())

    def broadcast_array(self, a: np.ndarray, what: str) -> np.ndarray:
        """rank 0's array `a` (this rank's array of the same shape and dtype is overwritten)."""
        self.wait([self.comm.Ibcast(a, root=0)], what)
        return a

    def barrier(self, what: str = "the other ranks") -> None:
        self.wait([self.comm.Ibarrier()], what)

    def agree(self, facts: Mapping[str, float]) -> None:
        """Check that every rank has the same `facts` ({what: number}, e.g. the data set's size);
        an InputError on every rank names the first that differs and each rank's value."""
        from ..errors import InputError
        names = list(facts)
        table = np.zeros((self.size, len(names)))
        table[self.rank] = [float(facts[n]) for n in names]
        table = self.sum(table.ravel(), "the other ranks' " + ", ".join(names)).reshape(self.size, len(names))
        for j, name in enumerate(names):
            if len(set(table[:, j])) > 1:
                each = ", ".join(f"rank {r}: {table[r, j]:g}" for r in range(self.size))
                raise InputError(f"the ranks differ in {name} ({each}); every rank must see the same")


def init(timeout: float = DEFAULT_TIMEOUT, comm: Any = None) -> World:
    """The job's World (MPI.COMM_WORLD unless `comm`), started once per process. With more than
    one rank an uncaught exception aborts the whole job (see the module docstring)."""
    global _world
    if _world is None:
        from ..extras import require
        MPI = require("mpi4py.MPI", "mpi")
        _world = World(comm if comm is not None else MPI.COMM_WORLD, timeout)
        if _world.size > 1:
            _abort_on_uncaught_exceptions(_world)
    return _world


def rank() -> int:
    """This process's rank (0 outside MPI)."""
    return init().rank if launched() or _world is not None else 0


def size() -> int:
    """The number of ranks (1 outside MPI)."""
    return init().size if launched() or _world is not None else 1


def _abort_on_uncaught_exceptions(world):
    previous = sys.excepthook

    def hook(kind, value, tb):
        if issubclass(kind, KeyboardInterrupt):
            return previous(kind, value, tb)
        text = "".join(traceback.format_exception(kind, value, tb))
        world.abort(f"stopping the job after an error:\n{text}")

    sys.excepthook = hook


class ShardedSampler:
    """The samples of each step of an epoch: global batches of `batch_size` from a permutation
    seeded by (seed, epoch), the same on every rank, each split into contiguous shards; a rank
    takes its own (`world` None: the whole batch). The last batch of an epoch may be short.

        sampler = ShardedSampler(len(data), 64, world, seed=0)
        for b in range(len(sampler)):
            index = sampler.indices(epoch, b)        # this rank's samples of global batch b
    """

    def __init__(self, count: int, batch_size: int, world: Optional[World] = None, seed: int = 0) -> None:
        if batch_size < 1 or count < 1:
            raise ValueError(f"ShardedSampler: expected at least one sample and a batch size of at least 1, "
                             f"found {count} sample(s), batch size {batch_size}")
        self.count, self.batch_size, self.world, self.seed = int(count), int(batch_size), world, seed
        self._order: Optional[tuple[int, np.ndarray]] = None  # (epoch, its permutation)

    def __len__(self):
        """Batches per epoch."""
        return -(-self.count // self.batch_size)

    def global_batch(self, epoch: int, b: int) -> np.ndarray:
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.random.default_rng([self.seed, epoch]).permutation(self.count))
        return self._order[1][b * self.batch_size:(b + 1) * self.batch_size]

    def indices(self, epoch: int, b: int) -> np.ndarray:
        index = self.global_batch(epoch, b)
        return index if self.world is None else shard(index, self.world)

    def positions(self, epoch: int, b: int) -> np.ndarray:
        """The places within global batch b of this rank's samples (`indices`): what keys a
        sample's own randomness, so it does not depend on how many ranks share the batch."""
        places = np.arange(len(self.global_batch(epoch, b)))
        return places if self.world is None else shard(places, self.world)


def shard(index: Any, world: World) -> np.ndarray:
    """This rank's part of a global batch's sample indices: contiguous, sizes differing by at
    most one. Empty when the batch has fewer samples than there are ranks (an epoch's short
    last batch): such a rank calls `net.idle_step(optimizer)` instead of `train_step`."""
    return np.array_split(np.asarray(index), world.size)[world.rank]


def data_parallel(net: Any, optimizer: Any, world: Optional[World] = None, bucket_mb: float = DEFAULT_BUCKET_MB,
                  seed: int = 0, overlap: bool = True) -> Any:
    """Make `optimizer` sum every gradient over the ranks before its update, after copying rank
    0's parameters, non-trainable state and optimizer state (moments, step counts) to every
    rank, so no rank starts apart. Dropout masks are drawn per rank (seeded by (seed, rank)).
    overlap=False starts every exchange at the step's end instead of during backward (the
    same result; for measuring what the overlap hides). Returns the optimizer."""
    from .reducer import GradientReducer
    world = world or init()
    check_same_network(world, net)
    broadcast_state(world, net, optimizer)
    net.seed([seed, world.rank])
    optimizer.reducer = GradientReducer(world, optimizer, int(bucket_mb * 2 ** 20), overlap)
    return optimizer


def check_same_network(world, net):
    """Abort with the first difference when a rank's network is not rank 0's: its graph (inputs,
    layers and their configuration, connections, outputs) or its parameters' names, shapes and
    types. Ranks whose parameters match but whose graphs differ (a ReLU here, a tanh there)
    would train a model that is neither."""
    from ..io.checkpoint import description_difference
    from ..io.model import describe_graph
    mine = [(name, tuple(p.shape), str(p.dtype)) for name, p in net.named_parameters()]
    graph = describe_graph(net)
    theirs, their_graph = world.broadcast((mine, graph), "rank 0's network")
    if mine != theirs:
        diff = next(((a, b) for a, b in zip(theirs, mine) if a != b), (len(theirs), len(mine)))
        world.abort(f"this rank's network differs from rank 0's: rank 0 has {diff[0]}, this rank {diff[1]}")
    differs = description_difference(their_graph, graph)
    if differs:
        world.abort(f"this rank's network differs from rank 0's graph: {differs} (rank 0's first)")


def broadcast_state(world, net, optimizer):
    """Copy rank 0's parameter values, optimizer state arrays and step counter to every rank."""
    named = net.named_parameters()
    for name, p in named:
        values = np.array(host(p.buffer), copy=True)
        world.broadcast_array(values, f"rank 0's values of '{name}'")
        if world.rank:
            p.assign(values)
    names = {id(p): name for name, p in named}
    layout = {names[id(p)]: {k: (tuple(np.shape(v)), str(np.asarray(host(v)).dtype)) for k, v in p.state.items()}
              for p in optimizer.params}
    layout, step_count = world.broadcast((layout, optimizer.step_count), "rank 0's optimizer state")
    by_name = dict(named)
    if world.rank:
        for p in optimizer.params:
            p.state = {}
    for name, states in layout.items():
        p = by_name[name]
        for key, (shape, dtype) in sorted(states.items()):
            a = np.array(host(p.state[key]), copy=True) if world.rank == 0 else np.empty(shape, dtype)
            world.broadcast_array(a, f"rank 0's optimizer state '{name}/{key}'")
            if world.rank:
                p.state[key] = a if a.ndim == 0 else p.placed(a)
    if world.rank:
        optimizer.step_count = int(step_count)
        optimizer.current_lr = optimizer.lr * optimizer.schedule(optimizer.step_count)
