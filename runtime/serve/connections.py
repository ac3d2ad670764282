"""Connection handling for `lamina serve` on Uvicorn: bounded time to send a request, and a
graceful stop that exits 0.

Uvicorn closes a keep-alive connection idle between requests, but it gives a new connection, or
one that has started a request, no deadline: a client that opens a socket and sends nothing, or
half a header, or half a body, holds it (and its buffers) forever. `RequestDeadline` gives every
connection `request_timeout` seconds from its opening, and from the first byte of each later
request, to deliver a whole request (headers and body); past that the connection is closed. The
number of connections is bounded by Uvicorn's `limit_concurrency` (503 past it).
"""
import signal

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


def deadline_protocol(request_timeout):
    """An HTTP protocol class (Uvicorn's httptools one) whose connections must deliver each
    request within `request_timeout` seconds."""

    class RequestDeadline(HttpToolsProtocol):
        def connection_made(self, transport):
            super().connection_made(transport)
            self._deadline = None
            self._arm()

        def on_message_begin(self):
            super().on_message_begin()
            self._arm()

        def on_message_complete(self):
            super().on_message_complete()
            self._disarm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

        def _arm(self):
            self._disarm()
            self._deadline = self.loop.call_later(request_timeout, self._expire)

        def _disarm(self):
            if getattr(self, "_deadline", None) is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expire(self):
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()  # a handler reading the body sees the client disconnect

    return RequestDeadline


class GracefulServer(uvicorn.Server):
    """A Uvicorn server that exits normally (status 0) after a graceful stop on SIGTERM or
    SIGINT, where Uvicorn raises the signal again once it has stopped (status 143 or 130). A
    second SIGINT still forces the stop. `grpc_port`: the port of the gRPC service beside it
    (None without one)."""

    grpc_port = None

    def handle_exit(self, sig, frame):
        super().handle_exit(sig, frame)
        if sig in (signal.SIGTERM, signal.SIGINT) and sig in self._captured_signals:
            self._captured_signals.remove(sig)
