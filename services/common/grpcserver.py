"""The one way every Trainyard service runs its gRPC server.

- An interceptor authenticates each call (API key in metadata -> Caller context variable), checks the request
  (services/common/request_checks.py: no NUL in a string, no NaN or infinity in a float, INVALID_ARGUMENT naming the
  field) before the servicer runs, and maps domain errors to status codes in one place, so servicers stay thin
  adapters without try/except. An unexpected error reaches the client as INTERNAL with an error id only; its detail
  goes to the log under that id. It also counts and times every call by method and status code
  (services/common/metrics.py) and opens the call's log scope (services/common/logs.py: request id, account, and the
  session or job the request names), and logs the call: at DEBUG when it succeeded, at INFO with its code otherwise.
- A server stream re-checks its caller's key every auth_recheck_s: once the key is revoked, the stream ends with
  UNAUTHENTICATED (the servicer's context.is_active() turns False, so watch loops stop at their next poll).
- It bounds the calls one account has in flight (max_concurrent_calls_per_account, RESOURCE_EXHAUSTED naming the
  quota), so one account cannot take every serving thread from the others, and gives each call a Cancellation
  (services/common/calls.py, `calls.current()`) that is cancelled when the client cancels, the deadline passes or the
  call ends, which servicers hand to their cores.
- TLS when the settings name a certificate (services/common/config.py), mutual TLS when they name a client CA.
- The standard grpc.health.v1 service and server reflection are registered for every service.
- SIGTERM/SIGINT: health flips to NOT_SERVING, new calls are refused, in-flight calls get shutdown_grace_s to finish,
  then the service's own shutdown hook runs (close engines, flush state) and the process exits.
"""
from __future__ import annotations

import contextlib
import logging
import re
import secrets
import signal
import threading
import time
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

from services.common import auth, calls, logs, metrics, request_checks
from services.common.errors import InvalidArgument, TrainyardError, Unauthenticated, log_internal
from services.common.quotas import quota_reached

log = logging.getLogger("trainyard.grpc")
rpc_log = logging.getLogger("trainyard.rpc")

PUBLIC_PREFIXES = ("/grpc.health.v1.", "/grpc.reflection.")
REQUEST_ID_KEY = "x-request-id"  # a client's own id for its call, kept in the call's log records
REQUEST_ID_RE = re.compile(r"[A-Za-z0-9._:-]{1,64}")
# Request fields that name the session or job a call is about, for the call's log records (a TrainerService's `id`
# is a session's, a JobService's a job's).
ID_FIELDS = {"session_id": "session_id", "job_id": "job_id"}
ID_BY_SERVICE = {"TrainerService": "session_id", "JobService": "job_id"}


# A status travels in the response's trailing metadata, which gRPC caps at 16 KiB by default: a message that echoes a
# client's 20000-character id would turn the answer into RESOURCE_EXHAUSTED. So what a status says is clipped.
MAX_MESSAGE_CHARS = 2000
MAX_DETAIL_CHARS = 300
MAX_VIOLATIONS = 20


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def _abort(context: grpc.ServicerContext, exc: TrainyardError) -> None:
    status = status_pb2.Status(code=exc.code.value[0], message=_clip(exc.message, MAX_MESSAGE_CHARS))
    if isinstance(exc, InvalidArgument) and exc.violations:
        bad = error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field=_clip(f"row {v.row}: {v.field}" if v.row else v.field, MAX_DETAIL_CHARS),
                description=_clip(v.reason, MAX_DETAIL_CHARS))
            for v in exc.violations[:MAX_VIOLATIONS]
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
    status = status_pb2.Status(code=code_pb2.INTERNAL, message=log_internal(log, method, exc))
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


class _KeyWatch:
    """Whether a long call's API key still authenticates, asked of the database at most every recheck_s."""

    def __init__(self, authenticate: Callable[[str | None], auth.Caller], key: str | None, recheck_s: float):
        self._authenticate, self._key, self._recheck_s = authenticate, key, recheck_s
        self._checked = time.monotonic()
        self.revoked = False

    def valid(self) -> bool:
        if not self.revoked and time.monotonic() - self._checked >= self._recheck_s:
            self._checked = time.monotonic()
            try:
                self._authenticate(self._key)
            except Unauthenticated:
                self.revoked = True
        return not self.revoked

    def check(self) -> None:
        if not self.valid():
            raise Unauthenticated("the API key of this call was revoked")


class _StreamContext:
    """The servicer's context of a server stream: grpc's, except that is_active() also turns False once the caller's
    key is revoked, so loops that poll it (WatchJob, WatchLineage) end at their next turn."""

    def __init__(self, context: grpc.ServicerContext, key: _KeyWatch):
        self._context, self._key = context, key

    def is_active(self) -> bool:
        return self._context.is_active() and self._key.valid()

    def __getattr__(self, name: str):
        return getattr(self._context, name)


class CallInterceptor(grpc.ServerInterceptor):
    """Authenticates (unless the method is public), bounds each account's calls in flight, gives the call its
    Cancellation, checks the request, observes the call and translates exceptions, for all four RPC shapes."""

    def __init__(self, authenticate: Callable[[str | None], auth.Caller], account_calls: AccountCalls,
                 auth_recheck_s: float = 2.0, count_streams: bool = True,
                 authorize: Callable[[auth.Caller, str, object], None] | None = None):
        """count_streams: whether a server stream counts against its account's calls in flight for its whole life
        (it holds a thread on a threaded server; not on the asyncio one). authorize: raises when the caller's key may
        not make this call with this request (a job-scoped key, services/common/auth.py)."""
        self._authenticate = authenticate
        self._authorize = authorize
        self._account_calls = account_calls
        self._recheck_s = auth_recheck_s
        self._count_streams = count_streams

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(PUBLIC_PREFIXES):
            return handler
        metadata = handler_call_details.invocation_metadata
        key = auth.key_from_metadata(metadata)
        authenticate, recheck_s, authorize = self._authenticate, self._recheck_s, self._authorize

        counted = self._count_streams or not handler.unary_stream
        account_calls = self._account_calls if counted else None

        def enter(context):
            try:
                caller = authenticate(key)
                if account_calls is not None:
                    account_calls.acquire(caller.account_id)
            except Exception as exc:  # noqa: BLE001 - e.g. the database is down while checking the key
                _fail(context, method, exc)
            logs.annotate(account_id=caller.account_id)
            return caller, auth.set_caller(caller), calls.set_current(_cancellation(context))

        def leave(entered) -> None:
            caller, caller_token, cancellation_token = entered
            calls.reset_current(cancellation_token)
            auth.reset_caller(caller_token)
            if account_calls is not None:
                account_calls.release(caller.account_id)

        def checked(request, streamed: bool, caller: auth.Caller):
            request = request_checks.check_stream(request) if streamed else request_checks.check(request)
            if authorize is None or not caller.job_id:
                return request
            if not streamed:
                authorize(caller, method, request)
                return request

            def each():
                for message in request:
                    authorize(caller, method, message)
                    yield message
            return each()

        def unary(fn, streamed: bool):
            def wrapped(request, context):
                with observed(method, metadata, request, context):
                    entered = enter(context)
                    try:
                        return fn(checked(request, streamed, entered[0]), context)
                    except Exception as exc:  # noqa: BLE001 - the one place exceptions become statuses
                        _fail(context, method, exc)
                    finally:
                        leave(entered)
            return wrapped

        def streaming(fn, streamed: bool):
            def wrapped(request, context):
                with observed(method, metadata, request, context):
                    entered = enter(context)
                    live = _KeyWatch(authenticate, key, recheck_s)
                    try:
                        for item in fn(checked(request, streamed, entered[0]), _StreamContext(context, live)):
                            live.check()
                            yield item
                        live.check()  # a watch that stopped because the key was revoked says so
                    except Exception as exc:  # noqa: BLE001 - the one place exceptions become statuses
                        _fail(context, method, exc)
                    finally:
                        leave(entered)
            return wrapped

        kw = dict(request_deserializer=request_checks.deserializer(handler.request_deserializer),
                  response_serializer=handler.response_serializer)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(unary(handler.unary_unary, False), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(unary(handler.stream_unary, True), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(streaming(handler.unary_stream, False), **kw)
        return grpc.stream_stream_rpc_method_handler(streaming(handler.stream_stream, True), **kw)


def _request_ids(method: str, metadata, request) -> dict[str, str]:
    """The call's request id (the client's, else a new one) and the session or job id its request names."""
    given = dict(metadata or ()).get(REQUEST_ID_KEY, "")
    ids = {"request_id": given if isinstance(given, str) and REQUEST_ID_RE.fullmatch(given) else secrets.token_hex(8)}
    fields = getattr(getattr(request, "DESCRIPTOR", None), "fields_by_name", {})
    for name, key in ID_FIELDS.items():
        if name in fields:
            ids[key] = getattr(request, name)
    service = method.lstrip("/").partition("/")[0].rpartition(".")[2]
    if service in ID_BY_SERVICE and "id" in fields:
        ids[ID_BY_SERVICE[service]] = request.id
    return ids


@contextlib.contextmanager
def observed(method: str, metadata, request, context: grpc.ServicerContext):
    """A call's log scope, its count and latency by status code, and its access log line."""
    start = time.perf_counter()
    with logs.scope(**_request_ids(method, metadata, request)):
        code = "OK"
        try:
            yield
        except GeneratorExit:  # the client left a server stream
            code = "CANCELLED"
            raise
        except BaseException:
            code = context.code().name if context.code() is not None else "UNKNOWN"
            raise
        finally:
            seconds = time.perf_counter() - start
            metrics.observe_rpc(method, code, seconds)
            rpc_log.log(logging.DEBUG if code == "OK" else logging.INFO, "%s %s %.1f ms", method, code,
                        seconds * 1000)


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
    """credentials: TLS (grpc.ssl_server_credentials), None for plain TCP."""

    streams_hold_threads = True  # each open server stream holds a thread of the pool (see _grpc_server)

    def __init__(self, spec: ServiceSpec, *, port: int, host: str, authenticate, workers: int,
                 max_message_mb: int, grace_s: float, max_calls_per_account: int, auth_recheck_s: float = 2.0,
                 credentials: grpc.ServerCredentials | None = None, metrics_port: int = 0, authorize=None):
        self.spec = spec
        self.grace_s = grace_s
        self.host, self.metrics_port = host, metrics_port
        self._metrics = None
        size = max_message_mb * 1024 * 1024
        self.account_calls = AccountCalls(max_calls_per_account, spec.name)
        self.interceptor = CallInterceptor(authenticate, self.account_calls, auth_recheck_s,
                                           self.streams_hold_threads, authorize)
        self.server = self._grpc_server(workers, options=[
            ("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
            ("grpc.so_reuseport", 0)])
        spec.register(self.server)
        self.health = health.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        names = [*spec.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME]
        reflection.enable_server_reflection(names, self.server)
        address = f"{host}:{port}"
        self.port = (self.server.add_secure_port(address, credentials) if credentials is not None
                     else self.server.add_insecure_port(address))
        if self.port == 0:
            raise OSError(f"{spec.name}: cannot listen on {host}:{port}")
        self.tls = credentials is not None
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
        if self.metrics_port:
            self._metrics = metrics.serve(self.host, self.metrics_port)
        self._start_grpc()
        for fn in self.spec.background:
            t = threading.Thread(target=fn, args=(self.stopping,), daemon=True, name=f"{self.spec.name}-bg")
            t.start()
            self._threads.append(t)
        for name in ["", *self.spec.service_names]:
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("%s listening on port %d (%s)", self.spec.name, self.port, "TLS" if self.tls else "plain TCP")

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
        if self._metrics is not None:
            self._metrics.shutdown()
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

    keys = KeyAuthenticator(db)
    return server_cls(spec, port=port, host=settings.host, authenticate=keys.authenticate, authorize=keys.authorize,
                      workers=settings.grpc_workers, max_message_mb=settings.grpc_max_message_mb,
                      grace_s=settings.shutdown_grace_s,
                      max_calls_per_account=settings.max_concurrent_calls_per_account,
                      auth_recheck_s=settings.auth_recheck_s, credentials=settings.server_credentials(),
                      metrics_port=settings.metrics_port)


def run_service(settings_cls, build: Callable[..., Server]) -> None:
    """A service's main(): settings from the environment, logging, then serve until SIGTERM."""
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    settings = settings_cls()
    logs.configure_logging(settings.log_level, settings.log_format)
    build(settings).serve_forever()


def service_names(*descriptors: Iterable) -> list[str]:
    return [d.full_name for d in descriptors]
