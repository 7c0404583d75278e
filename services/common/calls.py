"""What a core needs to know about the call it serves, without depending on gRPC: whether its client is gone.

The server's interceptor (services/common/grpcserver.py) gives every call a Cancellation, cancelled when its client
cancels, its deadline passes or the call ends, and makes it `current()` for the call; servicers pass it to their
cores, which check `cancelled` between pieces of work and register callbacks to wake up waits (an ordered call
waiting for its turn) or to abort work running elsewhere (an engine request).
"""
from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from dataclasses import dataclass


class Cancellation:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._callbacks: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Mark cancelled and run the callbacks (once, in the caller's thread)."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            fn()

    def add_callback(self, fn: Callable[[], None]) -> None:
        """Run fn on cancel; at once if already cancelled. Callbacks must be quick and must not raise."""
        with self._lock:
            if not self._cancelled:
                self._callbacks.append(fn)
                return
        fn()


class _Never(Cancellation):
    """For callers without a client that can go away (in-process use, tests)."""

    def cancel(self) -> None:
        raise AssertionError("NEVER is never cancelled")

    def add_callback(self, fn: Callable[[], None]) -> None:
        pass


NEVER: Cancellation = _Never()


_current: contextvars.ContextVar[Cancellation] = contextvars.ContextVar("trainyard_cancellation", default=NEVER)


def current() -> Cancellation:
    """The Cancellation of the call being served (NEVER outside a call)."""
    return _current.get()


def set_current(cancellation: Cancellation) -> contextvars.Token:
    return _current.set(cancellation)


def reset_current(token: contextvars.Token) -> None:
    _current.reset(token)


@dataclass(frozen=True)
class Wait:
    """Yielded by a blocking server-stream handler that has nothing to send yet: the asyncio server
    (services/common/aioserver.py) then waits on its event loop, holding no thread, until the callback it gives
    `on_ready` runs (from any thread, once) or timeout_s passes, and asks the handler for its next message. The
    call's interceptor sees every Wait go by, as it sees messages."""

    on_ready: Callable[[Callable[[], None]], None]
    timeout_s: float
