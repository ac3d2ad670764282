"""The one place that sets how many threads lamina uses, and the pieces of `split_work`.

`LAMINA_THREADS` sets the starting value; `set_num_threads` changes it at run time.
`split_work` runs independent pieces of one layer (the samples of a convolution, the column blocks
of a GEMM) on the threads instead, each with single-threaded kernels and BLAS.

This module knows no backend: a backend whose compiled kernels run on this process's threads
(the CPU backend: OpenMP kernels, MKL, OpenBLAS) registers its controls with `register_hooks`,
and every change of the thread count reaches them.
"""
import os
import queue
import threading
from concurrent.futures import Future

import numpy as np

from .errors import SettingError


class ThreadHooks:
    """The thread controls of a backend whose kernels run on this process's threads. These
    defaults do nothing: with no hooks registered, split_work's pieces are plain Python threads
    and its caller waits on their futures."""

    def set_num_threads(self, n):
        """Every kernel team and BLAS call of the backend uses n threads from now on."""

    def enter_split(self):
        """Before split_work's pieces start: their kernels and BLAS must run single-threaded and
        the backend's idle team must not spin on the pieces' CPUs. Returns what leave_split
        needs to restore."""

    def enter_piece(self):
        """On each piece's own thread, before it runs (a team's size may be per calling thread)."""

    def leave_split(self, saved, n):
        """After every piece has finished: back to n threads (saved: enter_split's value)."""

    def current_cpu(self):
        """The CPU the calling thread runs on, or -1 where unknown."""
        return -1

    def count_up(self, counter):
        """counter[0] += 1, atomically (counter: an int64 numpy array of one element)."""

    def wait_for(self, counter, n, spin_seconds):
        """Return once counter[0] >= n, spinning up to spin_seconds first; the default returns
        at once (split_work then waits on the pieces' futures)."""


_hooks = ThreadHooks()


def register_hooks(hooks):
    """Make `hooks` (a ThreadHooks) the controls every thread count change reaches; it is given
    the current count at once."""
    global _hooks
    _hooks = hooks
    if _current is not None:
        hooks.set_num_threads(_current)


_current = None
_local = threading.local()  # .in_split: this thread is running a piece of split_work


def _default_threads():
    env = os.environ.get("LAMINA_THREADS")
    if env is not None:
        try:
            n = int(env)
        except ValueError:
            raise SettingError(f"LAMINA_THREADS: expected a positive integer, found {env!r}") from None
        if n < 1:
            raise SettingError(f"LAMINA_THREADS: expected a positive integer, found {n}")
        return n
    return len(os.sched_getaffinity(0))


def set_num_threads(n):
    """Use n threads in every kernel and in both BLAS providers."""
    global _current
    n = int(n)
    if n < 1:
        raise SettingError(f"set_num_threads: expected a positive integer, found {n}")
    _current = n
    _hooks.set_num_threads(n)


def get_num_threads():
    return _current


def _in_split():
    return getattr(_local, "in_split", False)


def free_threads():
    """The threads a kernel called here may use: lamina's thread count, or 1 inside a run of
    split_work (its runs are single-threaded)."""
    return 1 if _in_split() else _current


# A caller that has done its own run spins up to this long for its workers to finish before it
# sleeps: on a virtual machine, waking a thread whose virtual CPU has halted costs tens of
# microseconds, as much as a small piece of work. The spin yields the CPU to any thread ready to
# run.
CALLER_SPIN = 2e-3


class _Worker:
    """A thread of split_work's own: runs the jobs put on its queue, one at a time."""

    def __init__(self, index):
        self.jobs = queue.SimpleQueue()
        self.cpu = None  # the one CPU it may run on (None: any)
        ready = threading.Event()

        def loop():
            self.tid = threading.get_native_id()
            ready.set()
            while (job := self.jobs.get()) is not None:
                job()
        self.thread = threading.Thread(target=loop, name=f"lamina-{index}", daemon=True)
        self.thread.start()
        ready.wait()

    def submit(self, fn, finished):
        """Run fn() on this worker; the Future it returns holds fn's exception, if any, and
        finished[0] counts up once fn is done."""
        done = Future()

        def job():
            try:
                fn()
            except BaseException as e:  # (handed to the caller)
                done.set_exception(e)
            else:
                done.set_result(None)
            finally:
                _hooks.count_up(finished)
        self.jobs.put(job)
        return done

    def pin(self, cpu):
        if cpu != self.cpu:
            try:
                os.sched_setaffinity(self.tid, {cpu})
                self.cpu = cpu
            except OSError:  # (a CPU taken away meanwhile: the worker runs where it may)
                self.cpu = None


_workers: list = []
_cpus = None  # the CPUs this process may use, sorted
_split_lock = threading.Lock()


def _forget_workers():  # a forked child has none of its parent's threads
    global _workers, _split_lock
    _workers, _split_lock = [], threading.Lock()


os.register_at_fork(after_in_child=_forget_workers)


def _place(workers):
    """Pin worker i to the i-th CPU after the caller's, when the process has a CPU for each thread.
    A woken thread otherwise goes where the OS chooses, and on a small virtual machine that is
    the caller's own core after an idle spell (a vCPU whose host thread slept counts as busy):
    the caller and the worker then take turns on one core."""
    global _cpus
    if _cpus is None:
        _cpus = sorted(os.sched_getaffinity(os.getpid()))
    if len(_cpus) <= len(workers):
        return
    here = _hooks.current_cpu()
    start = _cpus.index(here) if here in _cpus else 0
    for i, w in enumerate(workers, 1):
        w.pin(_cpus[(start + i) % len(_cpus)])


def split_work(count, work, threads=None):
    """work(t, items) for t < T, where the T runs `items` cover range(count) in order and each
    is non-empty, T = min(threads or lamina's thread count, count); returns T. With T > 1 the
    calling thread takes run 0 and each other run goes to one of lamina's workers, pinned to
    the CPUs after the caller's (_place); every run's kernels and BLAS calls are
    single-threaded (the kernels release the GIL), so the pieces run side by side with no team
    to wake inside them; MKL returns to the full thread count afterwards. The first exception
    raised by a run is re-raised here, after every run has finished. Called from inside a run,
    it works on that run's thread alone (T = 1).
    (The caller works instead of waiting: one thread to wake fewer, and its core stays busy.)"""
    count = int(count)
    threads = 1 if _in_split() else min(threads or _current, count)
    if threads <= 1:
        if count:
            work(0, range(count))
        return max(threads, 0)
    with _split_lock:  # one split at a time: MKL's thread count is process-wide
        while len(_workers) < threads - 1:
            _workers.append(_Worker(len(_workers) + 1))
        helpers = _workers[:threads - 1]
        _place(helpers)

        def run(t):
            _hooks.enter_piece()
            _local.in_split = True
            try:
                work(t, range(t * count // threads, (t + 1) * count // threads))
            finally:
                _local.in_split = False

        saved = _hooks.enter_split()
        errors: list = [None]
        finished = np.zeros(1, np.int64)
        try:
            futures = [w.submit(lambda t=t: run(t), finished) for t, w in enumerate(helpers, 1)]
            try:
                run(0)
            except BaseException as e:  # kept until the other runs have finished
                errors[0] = e
            _hooks.wait_for(finished, len(futures), CALLER_SPIN)
            errors += [f.exception() for f in futures]
        finally:
            _hooks.leave_split(saved, _current)
        for error in errors:
            if error is not None:
                raise error
    return threads


# A bad LAMINA_THREADS must not make `import lamina` fail (the `lamina` command could not even
# report it): the error is kept and raised by the first Network made (check_environment), and the
# command reports it in one line.
ENV_ERROR = None
try:
    _start = _default_threads()
except SettingError as _e:
    ENV_ERROR, _start = _e, len(os.sched_getaffinity(0))
set_num_threads(_start)


def check_environment():
    """Raise the error of a bad LAMINA_THREADS or LAMINA_BLAS, if there is one."""
    if ENV_ERROR is not None:
        raise ENV_ERROR
    for check in _environment_checks:
        try:
            check()
        except ValueError as e:
            raise SettingError(str(e)) from None


_environment_checks: list = []  # a backend's checks of its own settings (LAMINA_BLAS), raising ValueError


def register_environment_check(check):
    _environment_checks.append(check)
