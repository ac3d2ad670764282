"""A readers-writer lock: many inference runs share a network, while whatever changes it (a
training step, an optimizer update, a move to another device) waits for them and runs alone.

Writers are preferred: once one waits, new readers queue behind it, so a stream of inference
requests cannot starve training. Both sides are re-entrant per thread (a training step that runs
an inference forward inside, a reader that reads again), and a thread holding the write side may
also read. A thread that holds the read side and asks for the write side would wait for itself
forever; that is an error here, not a deadlock.
"""
import threading
from contextlib import contextmanager


class ReadWriteLock:
    def __init__(self):
        self._cond = threading.Condition(threading.Lock())
        self._readers = {}  # thread id -> read depth
        self._writer = None  # thread id holding the write side
        self._write_depth = 0
        self._writers_waiting = 0

    @contextmanager
    def read(self):
        me = threading.get_ident()
        with self._cond:
            if self._writer != me and me not in self._readers:
                while self._writer is not None or self._writers_waiting:
                    self._cond.wait()
            self._readers[me] = self._readers.get(me, 0) + 1
        try:
            yield
        finally:
            with self._cond:
                depth = self._readers[me] - 1
                if depth:
                    self._readers[me] = depth
                else:
                    del self._readers[me]
                    self._cond.notify_all()

    @contextmanager
    def write(self):
        me = threading.get_ident()
        with self._cond:
            if self._writer != me:
                if me in self._readers:
                    raise RuntimeError("this thread is reading the network (inside a run) and asked to "
                                       "change it; finish the run first")
                self._writers_waiting += 1
                try:
                    while self._writer is not None or self._readers:
                        self._cond.wait()
                finally:
                    self._writers_waiting -= 1
                self._writer = me
            self._write_depth += 1
        try:
            yield
        finally:
            with self._cond:
                self._write_depth -= 1
                if not self._write_depth:
                    self._writer = None
                    self._cond.notify_all()
