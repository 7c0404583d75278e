"""The asyncio variant of the service runner (grpcserver.Server), for a service whose long streams must not each hold
a thread: weightsync's WatchLineage, open for as long as a lineage deployment lives. A threaded gRPC server gives
every open stream a thread whatever its handler does; here a stream waits on the event loop, so thousands can be
open with the default grpc_workers.

Handlers stay ordinary blocking servicer methods, wrapped by the same CallInterceptor as on the threaded servers
(authentication, per-account calls in flight, the call's Cancellation, the mapping of errors to statuses), and run
in a pool of grpc_workers threads:
- a unary call runs in the pool from start to end;
- a client stream (an upload) is read by its handler in the pool, message by message from the loop;
- a server stream's messages are produced in the pool one at a time and sent from the loop, so its thread is busy
  only while a message is produced. A handler with nothing to send yields calls.Wait: the loop waits for its
  on_ready callback (or its timeout) without a thread, then asks for the next message. Server streams hold no
  thread between messages, so they do not count against max_concurrent_calls_per_account here (what they wait on
  bounds itself: max_watches_per_account).

Ordering of one call: the loop accepts it -> every step of the wrapped handler runs in the pool under one
contextvars.Context (a stream's steps share it, so its caller and Cancellation stay set), one step at a time -> the
result, each message or the abort the handler recorded goes back to the loop. The call's Cancellation fires from the
loop when the RPC ends (client cancel, deadline or completion), which also ends a pooled read of a client stream.
"""
from __future__ import annotations

import asyncio
import contextvars
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures

import grpc

from services.common import calls
from services.common.errors import Cancelled
from services.common.grpcserver import PUBLIC_PREFIXES, Server

_END = object()


async def _next_message(request_iterator):
    return await anext(request_iterator, _END)


class _Aborted(Exception):
    """Raised in the pool where a threaded server's context.abort raises; the loop then aborts the real call."""


class _PoolContext:
    """What a pooled handler sees as its grpc.ServicerContext: the methods Trainyard's interceptor and servicers use,
    safe to call from a pool thread."""

    def __init__(self, context: grpc.aio.ServicerContext, cancellation: calls.Cancellation):
        self._context = context
        self._cancellation = cancellation
        self.aborted: tuple[grpc.StatusCode, str, tuple] | None = None

    def code(self):
        return self.aborted[0] if self.aborted else None

    def abort(self, code: grpc.StatusCode, details: str):
        self.aborted = (code, details, ())
        raise _Aborted(details)

    def abort_with_status(self, status: grpc.Status):
        self.aborted = (status.code, status.details, tuple(status.trailing_metadata or ()))
        raise _Aborted(status.details)

    def add_callback(self, fn: Callable[[], None]) -> bool:
        if self._cancellation.cancelled:
            return False
        self._cancellation.add_callback(fn)
        return True

    def is_active(self) -> bool:
        return not self._cancellation.cancelled

    def time_remaining(self):
        return self._context.time_remaining()

    def invocation_metadata(self):
        return self._context.invocation_metadata()


class _PooledCall:
    """One call's context on the pool side: every step runs under the same contextvars.Context, one at a time."""

    def __init__(self, pool: futures.Executor, context: grpc.aio.ServicerContext):
        self.pool = pool
        self.loop = asyncio.get_running_loop()
        self.cancellation = calls.Cancellation()
        context.add_done_callback(lambda _ctx: self.cancellation.cancel())
        self.pool_context = _PoolContext(context, self.cancellation)
        self._vars = contextvars.copy_context()
        self._turn = threading.Lock()

    def _in_context(self, fn, *args):
        with self._turn:
            return self._vars.run(fn, *args)

    async def run(self, fn, *args):
        return await self.loop.run_in_executor(self.pool, self._in_context, fn, *args)

    def submit(self, fn, *args) -> None:
        """Run fn in the pool without waiting for it (e.g. closing a stream the client left)."""
        self.pool.submit(self._in_context, fn, *args)

    def requests(self, request_iterator) -> Iterator:
        """The client's async stream of messages as a blocking iterator for the pool; it ends the call as
        CANCELLED when the client goes away."""
        def read():
            while True:
                if self.cancellation.cancelled:
                    raise Cancelled("the client ended the stream before its last message")
                pending = asyncio.run_coroutine_threadsafe(_next_message(request_iterator), self.loop)
                self.cancellation.add_callback(pending.cancel)
                try:
                    message = pending.result()
                except (futures.CancelledError, grpc.RpcError, asyncio.CancelledError):
                    raise Cancelled("the client ended the stream before its last message") from None
                if message is _END:
                    return
                yield message
        return read()

    async def wait(self, wait: calls.Wait) -> None:
        ready = self.loop.create_future()

        def set_ready() -> None:
            if not ready.done():
                ready.set_result(None)

        wait.on_ready(lambda: self.loop.call_soon_threadsafe(set_ready))
        await asyncio.wait([ready], timeout=wait.timeout_s)

    async def abort(self, context: grpc.aio.ServicerContext) -> None:
        code, details, trailing = self.pool_context.aborted
        await context.abort(code, details, trailing)


class AsyncCallInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, interceptor, pool: futures.Executor):
        self._sync = interceptor  # grpcserver.CallInterceptor
        self._pool = pool

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(PUBLIC_PREFIXES):
            return handler
        wrapped = self._sync.intercept_service(lambda _details: handler, handler_call_details)
        kw = dict(request_deserializer=wrapped.request_deserializer, response_serializer=wrapped.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(self._pooled_unary(wrapped.unary_unary), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(self._pooled_client_stream(wrapped.stream_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(self._pooled_stream(wrapped.unary_stream), **kw)
        raise NotImplementedError(f"{method}: bidirectional streams are not served by the asyncio server")

    def _pooled_unary(self, wrapped):
        async def handle(request, context):
            call = _PooledCall(self._pool, context)
            try:
                return await call.run(wrapped, request, call.pool_context)
            except _Aborted:
                await call.abort(context)
        return handle

    def _pooled_client_stream(self, wrapped):
        async def handle(request_iterator, context):
            call = _PooledCall(self._pool, context)
            try:
                return await call.run(wrapped, call.requests(request_iterator), call.pool_context)
            except _Aborted:
                await call.abort(context)
        return handle

    def _pooled_stream(self, wrapped):
        async def handle(request, context) -> AsyncIterator:
            call = _PooledCall(self._pool, context)
            messages = wrapped(request, call.pool_context)  # a generator: nothing runs until its first step
            try:
                while (message := await call.run(next, messages, _END)) is not _END:
                    if isinstance(message, calls.Wait):
                        await call.wait(message)
                    else:
                        yield message
            except _Aborted:
                await call.abort(context)
            finally:
                call.submit(messages.close)  # a client that left: the handler's cleanup runs in the pool
        return handle


class AsyncServer(Server):
    """grpcserver.Server on a grpc.aio server: its event loop runs in a thread of its own, handlers in a pool of
    `workers` threads. The number of calls in flight is not capped here (streams on the loop cost no thread); each
    account's unary calls and uploads are (max_concurrent_calls_per_account)."""

    streams_hold_threads = False

    def _grpc_server(self, workers: int, options: list[tuple]):
        self.loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                             name=f"{self.spec.name}-loop")
        self._loop_thread.start()
        self.pool = futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self.spec.name)

        async def make():
            return grpc.aio.server(self.pool, interceptors=[AsyncCallInterceptor(self.interceptor, self.pool)],
                                   options=options)

        return self.on_loop(make())

    def on_loop(self, coro):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def _start_grpc(self) -> None:
        self.on_loop(self.server.start())

    def _stop_grpc(self) -> None:
        self.on_loop(self.server.stop(self.grace_s))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._loop_thread.join(timeout=5)
        self.pool.shutdown(wait=False, cancel_futures=True)
