"""The one way every Trainyard service runs its gRPC server.

- An interceptor authenticates each call (API key in metadata -> Caller context variable) and maps domain errors to
  status codes in one place, so servicers stay thin adapters without try/except.
- It also bounds the calls one account has in flight (max_concurrent_calls_per_account, RESOURCE_EXHAUSTED naming
  the quota), so one account cannot take every serving thread from the others, and gives each call a Cancellation
  (services/common/calls.py, `calls.current()`) that is cancelled when the client cancels, the deadline passes or the
  call ends, which servicers hand to their cores.
- The standard grpc.health.v1 service and server reflection are registered for every service.
- SIGTERM/SIGINT: health flips to NOT_SERVING, new calls are refused, in-flight calls get shutdown_grace_s to finish,
  then the service's own shutdown hook runs (close engines, flush state) and the process exits.
"""
from __future__ import annotations

import logging
import signal
import threading
from collections import Counter
from collections.abc import Callable, Iterable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
import sqlalchemy.exc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from services.common import auth, calls
from services.common.errors import InvalidArgument, TrainyardError
from services.common.quotas import quota_reached

log = logging.getLogger("trainyard.grpc")

PUBLIC_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")


def _abort(context: grpc.ServicerContext, exc: TrainyardError) -> None:
    status = status_pb2.Status(code=exc.code.value[0], message=exc.message)
    if isinstance(exc, InvalidArgument) and exc.violations:
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field=f"row {v.row}: {v.field}" if v.row else v.field, description=v.reason)
            for v in exc.violations
        ])
        detail = any_pb2.Any()
        detail.Pack(bad)
        status.details.append(detail)
    context.abort_with_status(rpc_status.to_status(status))


def _fail(context: grpc.ServicerContext, method: str, exc: Exception) -> None:
    if isinstance(exc, TrainyardError):
        _abort(context, exc)
    if context.code() not in (None, grpc.StatusCode.OK):
        raise exc  # the call was already aborted with its own status
    if isinstance(exc, sqlalchemy.exc.OperationalError):
        log.error("database error in %s: %s", method, exc)
        context.abort(grpc.StatusCode.UNAVAILABLE, f"{method}: the database is unavailable; try again shortly")
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        # A downstream service failed: keep its status code, say which call it was.
        context.abort(exc.code(), f"{method}: {exc.details()}")
    log.exception("unhandled error in %s", method)
    status = status_pb2.Status(code=code_pb2.INTERNAL, message=f"internal error in {method}: {exc}")
    context.abort_with_status(rpc_status.to_status(status))


class AccountCalls:
    """Calls in flight per account, at most `limit` each."""

    def __init__(self, limit: int, service: str):
        self.limit, self.service = limit, service
        self._lock = threading.Lock()
        self._in_flight: Counter[str] = Counter()

    def acquire(self, account_id: str) -> None:
        with self._lock:
            if self._in_flight[account_id] >= self.limit:
                raise quota_reached("max_concurrent_calls_per_account", self.limit,
                                    f"the account has {self.limit} calls in flight on the {self.service}; "
                                    "retry when some have finished")
            self._in_flight[account_id] += 1

    def release(self, account_id: str) -> None:
        with self._lock:
            self._in_flight[account_id] -= 1
            if not self._in_flight[account_id]:
                del self._in_flight[account_id]

    def in_flight(self, account_id: str) -> int:
        with self._lock:
            return self._in_flight[account_id]


def _cancellation(context: grpc.ServicerContext) -> calls.Cancellation:
    """Cancelled when the call terminates: client cancel, deadline, or its end (add_callback's contract)."""
    cancellation = calls.Cancellation()
    if not context.add_callback(cancellation.cancel):  # the call has terminated already
        cancellation.cancel()
    return cancellation


class CallInterceptor(grpc.ServerInterceptor):
    """Authenticates (unless the method is public), bounds each account's calls in flight, gives the call its
    Cancellation, and translates exceptions, for all four RPC shapes."""

    def __init__(self, authenticate: Callable[[str | None], auth.Caller], account_calls: AccountCalls,
                 count_streams: bool = True):
        """count_streams: whether a server stream counts against its account's calls in flight for its whole life
        (it holds a thread on a threaded server; not on the asyncio one)."""
        self._authenticate = authenticate
        self._account_calls = account_calls
        self._count_streams = count_streams

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(PUBLIC_PREFIXES):
            return handler
        metadata = handler_call_details.invocation_metadata
        authenticate = self._authenticate
        counted = self._count_streams or not handler.unary_stream
        account_calls = self._account_calls if counted else None

        def enter(context):
            try:
                caller = authenticate(auth.key_from_metadata(metadata))
                if account_calls is not None:
                    account_calls.acquire(caller.account_id)
            except Exception as exc:  # noqa: BLE001 - e.g. the database is down while checking the key
                _fail(context, method, exc)
            return caller, auth.set_caller(caller), calls.set_current(_cancellation(context))

        def leave(entered) -> None:
            caller, caller_token, cancellation_token = entered
            calls.reset_current(cancellation_token)
            auth.reset_caller(caller_token)
            if account_calls is not None:
                account_calls.release(caller.account_id)

        def unary(fn):
            def wrapped(request, context):
                entered = enter(context)
                try:
                    return fn(request, context)
                except Exception as exc:  # noqa: BLE001 - the one place exceptions become statuses
                    _fail(context, method, exc)
                finally:
                    leave(entered)
            return wrapped

        def streaming(fn):
            def wrapped(request, context):
                entered = enter(context)
                try:
                    yield from fn(request, context)
                except Exception as exc:  # noqa: BLE001 - the one place exceptions become statuses
                    _fail(context, method, exc)
                finally:
                    leave(entered)
            return wrapped

        kw = dict(request_deserializer=handler.request_deserializer, response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream), **kw)
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream), **kw)


@dataclass
class ServiceSpec:
    """What a service plugs into the runner: its servicers, their full names, and hooks."""

    name: str
    register: Callable[[grpc.Server], None]
    service_names: list[str]
    on_shutdown: Callable[[], None] | None = None
    background: list[Callable[[threading.Event], None]] = field(default_factory=list)
    # Set when shutdown begins: background loops and long streams watch it to finish early.
    stopping: threading.Event = field(default_factory=threading.Event)


class Server:
    streams_hold_threads = True  # each open server stream holds a thread of the pool (see _grpc_server)

    def __init__(self, spec: ServiceSpec, *, port: int, host: str, authenticate, workers: int,
                 max_message_mb: int, grace_s: float, max_calls_per_account: int):
        self.spec = spec
        self.grace_s = grace_s
        size = max_message_mb * 1024 * 1024
        self.account_calls = AccountCalls(max_calls_per_account, spec.name)
        self.interceptor = CallInterceptor(authenticate, self.account_calls, self.streams_hold_threads)
        self.server = self._grpc_server(workers, options=[
            ("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
            ("grpc.so_reuseport", 0)])
        spec.register(self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*spec.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        self.port = self.server.add_insecure_port(f"{host}:{port}")
        if self.port == 0:
            raise OSError(f"{spec.name}: cannot listen on {host}:{port}")
        self.stopping = spec.stopping
        self._threads: list[threading.Thread] = []

    def _grpc_server(self, workers: int, options: list[tuple]) -> grpc.Server:
        """Threaded: each call holds one of `workers` threads; beyond twice that many calls in flight, new ones are
        refused (RESOURCE_EXHAUSTED) rather than queued."""
        return grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=self.spec.name),
                           interceptors=[self.interceptor], maximum_concurrent_rpcs=2 * workers, options=options)

    def _start_grpc(self) -> None:
        self.server.start()

    def _stop_grpc(self) -> None:
        self.server.stop(self.grace_s).wait()

    def start(self) -> None:
        self._start_grpc()
        for fn in self.spec.background:
            t = threading.Thread(target=fn, args=(self.stopping,), daemon=True, name=f"{self.spec.name}-bg")
            t.start()
            self._threads.append(t)
        for name in ["", *self.spec.service_names]:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s listening on port %d", self.spec.name, self.port)

    def stop(self) -> None:
        """Graceful: refuse new calls, let in-flight ones finish (up to grace_s), then run the shutdown hook."""
        if self.stopping.is_set():
            return
        self.stopping.set()
        self.health.enter_graceful_shutdown()
        log.info("%s shutting down (grace %.0fs)", self.spec.name, self.grace_s)
        self._stop_grpc()
        for t in self._threads:
            t.join(timeout=self.grace_s)
        if self.spec.on_shutdown is not None:
            self.spec.on_shutdown()
        log.info("%s stopped", self.spec.name)

    def serve_forever(self) -> None:
        """Start, then block until SIGTERM/SIGINT and shut down gracefully."""
        done = threading.Event()

        def on_signal(signum, _frame):
            log.info("%s received %s", self.spec.name, signal.Signals(signum).name)
            done.set()

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.start()
        # Poll rather than block: the kernel may deliver SIGTERM to any thread, and Python runs signal handlers
        # only when the main thread next executes bytecode, which a lock wait without timeout never does.
        while not done.wait(0.5):
            pass
        self.stop()


def service_server(spec: ServiceSpec, settings, port: int, db, server_cls: type[Server] = Server) -> Server:
    """A Server (or server_cls: services/common/aioserver.py's AsyncServer) for one service, configured from the
    shared settings and authenticating against db."""
    from services.common.auth import KeyAuthenticator

    return server_cls(spec, port=port, host=settings.host, authenticate=KeyAuthenticator(db).authenticate,
                  workers=settings.grpc_workers, max_message_mb=settings.grpc_max_message_mb,
                  grace_s=settings.shutdown_grace_s,
                  max_calls_per_account=settings.max_concurrent_calls_per_account)


def run_service(settings_cls, build: Callable[..., Server]) -> None:
    """A service's main(): settings from the environment, logging, then serve until SIGTERM."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = settings_cls()
    configure_logging(settings.log_level)
    build(settings).serve_forever()


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def service_names(*descriptors: Iterable) -> list[str]:
    return [d.full_name for d in descriptors]
