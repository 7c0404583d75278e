"""APIFuture: the result of a Training API or sampling call that is already on its way to the server.

Wait for it in plain code with .result(timeout=None), or in async code with `await fut` / `await fut.result_async()`
(as Tinker's APIFuture). A failed call raises its error from either: trainyard.errors.TrainyardError for a server
error, ValueError for input the client refused.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import inspect
from collections.abc import Callable, Generator
from typing import Any, Generic, TypeVar

import grpc

from trainyard.errors import from_rpc_error

T = TypeVar("T")


class APIFuture(Generic[T]):
    def __init__(self, future: concurrent.futures.Future):
        self._future = future

    @classmethod
    def completed(cls, value: T) -> APIFuture[T]:
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_result(value)
        return cls(f)

    @classmethod
    def failed(cls, exc: BaseException) -> APIFuture[Any]:
        f: concurrent.futures.Future = concurrent.futures.Future()
        f.set_exception(exc)
        return cls(f)

    @classmethod
    def from_grpc(cls, call: grpc.Future, convert: Callable[[Any], T]) -> APIFuture[T]:
        """A future of convert(response) for a call started with a stub method's .future(...)."""
        out: concurrent.futures.Future = concurrent.futures.Future()

        def done(f: grpc.Future) -> None:
            try:
                out.set_result(convert(f.result()))
            except grpc.RpcError as exc:
                out.set_exception(from_rpc_error(exc))
            except Exception as exc:  # noqa: BLE001 - a bad response surfaces through the future, not a grpc thread
                out.set_exception(exc)

        call.add_done_callback(done)
        return cls(out)

    def result(self, timeout: float | None = None) -> T:
        """Block until the call finished (TimeoutError after timeout seconds) and return its result or raise."""
        return self._future.result(timeout)

    async def result_async(self, timeout: float | None = None) -> T:
        return await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(self._future)), timeout)

    async def coroutine(self) -> T:
        """The result, from a coroutine (as Tinker's APIFuture.coroutine)."""
        return await self.result_async()

    def __await__(self) -> Generator[Any, None, T]:
        return self.result_async().__await__()

    def done(self) -> bool:
        return self._future.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._future.exception(timeout)

    def add_done_callback(self, fn: Callable[[APIFuture[T]], None]) -> None:
        self._future.add_done_callback(lambda _: fn(self))

    def future(self) -> concurrent.futures.Future:
        """The underlying concurrent.futures.Future."""
        return self._future

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._future.exception() else "done")
        return f"<APIFuture {state}>"


def async_twin_signatures(cls: type) -> type:
    """Class decorator: each `<name>_async(self, *args, **kwargs)` that forwards to `<name>` shows `<name>`'s
    parameters (inspect.signature, help(), editors), as Tinker's twins declare them."""
    for name, fn in list(vars(cls).items()):
        if name.endswith("_async") and callable(fn) and hasattr(cls, name.removesuffix("_async")):
            params = list(inspect.signature(fn).parameters)
            if params == ["self", "args", "kwargs"]:
                sync = inspect.signature(getattr(cls, name.removesuffix("_async")))
                fn.__signature__ = sync.replace(return_annotation=inspect.signature(fn).return_annotation)
    return cls
