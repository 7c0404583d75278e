"""How a TrainingClient's calls reach the trainer (trainyard/training.py holds the calls themselves).

Ordering. Every call on a TrainingClient takes the session's next seq_id when it is made (under a lock, in the order
the caller makes them) and is queued at once for a worker thread that sends it; the trainer runs a session's calls in
seq_id order, so calls are pipelined: optim_step is on the wire before forward_backward's result is back. Workers
take calls first in, first out, so a call is never sent before an earlier call of its client was, and no call waits
on the server for one still queued here. forward_backward_custom takes two consecutive seq_ids (a Forward, then a
ForwardBackward with the gradient of the user's loss as weights).

Failures mirror the trainer's (trainer.proto): INVALID_ARGUMENT uses up the call's seq_id and changes nothing, so the
client goes on. Any other failure may have left the session half-updated: the trainer refuses its later calls
(FAILED_PRECONDITION), and this client refuses calls made after it learned of the failure, without sending them (and
those made before but not yet sent), with a TrainyardError (FAILED_PRECONDITION) naming the failed call.

Restarts. A session survives a restart of the trainer (services/trainer/sessions.py: it comes back at its last
recorded state; a graceful restart records every session first). A call answered UNAVAILABLE (the trainer is down,
restarting, or refused it while shutting down) is not an error yet: the client waits for the trainer -- up to
ServiceClient's retry_unavailable_s -- asks it which seq_id the session expects next (n), and then
  - sends the call again, transparently, when n <= its seq_id and every call this client had answered lies below n
    (nothing the client saw was lost; a stream of an iterator, which cannot be sent twice, fails with UNAVAILABLE
    instead and uses up its seq_id, the session unchanged);
  - fails it with ABORTED when a call the trainer had answered has seq_id >= n: those calls were lost (a crash took
    the session back to its last record). The client refuses its later calls; continue with
    ServiceClient.resume_training_client(session id), which goes on at seq_id n (get_info() tells the step).
    Every ordered call also tells the trainer the highest seq_id answered (metadata ANSWERED_KEY), so a call made
    after the trainer came back, which sees no UNAVAILABLE, gets the same ABORTED at once;
  - fails it with UNAVAILABLE when n > its seq_id: the trainer took the call (a SaveWeights whose publish the
    weight-sync service refused, or a call whose answer a restart cut off); the session holds whatever it did and
    goes on.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import grpc

from trainyard.errors import TrainyardError, from_rpc_error
from trainyard.futures import APIFuture
from trainyard.v1 import trainer_pb2 as tpb

# Metadata of every ordered call: the highest seq_id whose answer this client has, so a trainer that restored the
# session to before it answers ABORTED at once (trainer.proto) instead of waiting for calls that will not come again.
ANSWERED_KEY = "trainyard-answered-seq-id"


class SessionUnchanged(Exception):
    """Raised by a call's body for a failure that left the session as it was (the client goes on)."""

    def __init__(self, error: BaseException):
        super().__init__(str(error))
        self.error = error


def session_when_reachable(stub, metadata, session_id: str, deadline: float) -> tpb.Session:
    """GetSession, waiting while the trainer is unreachable or restarting, until deadline (then UNAVAILABLE)."""
    pause = 0.2
    while True:
        remaining = deadline - time.monotonic()
        try:
            return stub.GetSession(tpb.GetSessionRequest(id=session_id), metadata=metadata,
                                   timeout=max(remaining, 0.01), wait_for_ready=True)
        except grpc.RpcError as exc:
            unreachable = exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
            if not unreachable:
                raise from_rpc_error(exc) from None
            if time.monotonic() + pause >= deadline:
                raise TrainyardError("UNAVAILABLE", f"the trainer was not back within the retry time "
                                     f"(retry_unavailable_s): {exc.details()}") from None
        time.sleep(pause)  # a trainer shutting down refuses at once: do not spin
        pause = min(2 * pause, 2.0)


class OrderedCalls:
    """The sending half of a TrainingClient: seq_ids, the worker pool, failures, and restarts."""

    def __init__(self, service, session: tpb.Session):
        self.service = service
        self.model_id = session.id
        self._stub, self._md = service.trainer, service.metadata
        self._lock = threading.Lock()
        self._next_seq_id = session.next_seq_id or 1
        # The highest seq_id the trainer answered (whatever the answer): a restored session must be past it, or
        # calls this client saw were lost ("Restarts" above).
        self._answered = self._next_seq_id - 1
        self._failure = ""  # the first call that failed and may have left the session half-updated
        self._closed = False
        self._pending: set = set()

    def _submit(self, name: str, n_seq_ids: int, body: Callable[[int], Any]) -> APIFuture:
        with self._lock:
            if self._closed:
                return APIFuture.failed(TrainyardError("FAILED_PRECONDITION", f"{name}: the training client of "
                                                       f"session {self.model_id} is closed"))
            if self._failure:
                return APIFuture.failed(TrainyardError("FAILED_PRECONDITION", (
                    f"{name} was not sent: an earlier call on session {self.model_id} failed ({self._failure}), so "
                    "the session may be half-updated and its later calls are refused; start a new training client "
                    "(e.g. from a state saved with save_state)")))
            seq_id = self._next_seq_id
            self._next_seq_id += n_seq_ids
            future = self.service.pool.submit(self._run, name, seq_id, body)
            self._pending.add(future)
        future.add_done_callback(self._done)
        return APIFuture(future)

    def _done(self, future) -> None:
        with self._lock:
            self._pending.discard(future)

    def _run(self, name: str, seq_id: int, body: Callable[[int], Any]) -> Any:
        with self._lock:
            failure = self._failure
        if failure:  # made before the client learned of it, not sent yet: it would only wait on the trainer
            raise TrainyardError("FAILED_PRECONDITION", f"{name} was not sent: an earlier call on session "
                                 f"{self.model_id} failed ({failure})")
        try:
            return body(seq_id)
        except SessionUnchanged as exc:
            raise exc.error from None
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
            if error.code != "INVALID_ARGUMENT":
                self._fail(f"{name}, seq_id {seq_id}: {error}")
            raise error from None
        except Exception as exc:
            self._fail(f"{name}, seq_id {seq_id}: {type(exc).__name__}: {exc}")
            raise

    def _fail(self, description: str) -> None:
        with self._lock:
            self._failure = self._failure or description

    def _call(self, method: str, request) -> Any:
        return getattr(self._stub, method)(request, metadata=self._md)

    def _ordered(self, method: str, request, seq_id: int | None = None, resendable: bool = True) -> Any:
        """An ordered call (request: the message, or a function making a client stream's iterator; seq_id: the
        request's), waiting for the trainer and sent again while it is unreachable or restarting (module
        docstring, "Restarts")."""
        seq_id = request.seq_id if seq_id is None else seq_id
        deadline = None
        while True:
            with self._lock:
                metadata = (*self._md, (ANSWERED_KEY, str(self._answered)))
            try:
                response = getattr(self._stub, method)(request() if callable(request) else request, metadata=metadata)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.ABORTED:
                    raise TrainyardError("ABORTED", f"{exc.details()} (ServiceClient.resume_training_client("
                                         f"{self.model_id!r}) goes on from there)") from None
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    self._answer(seq_id)
                    raise
                deadline = deadline or time.monotonic() + self.service.retry_unavailable_s
                self._before_sending_again(seq_id, exc, deadline)
                if not resendable:
                    self._skip(seq_id)
                    raise SessionUnchanged(TrainyardError("UNAVAILABLE", (
                        f"{method}, seq_id {seq_id}: the trainer restarted before it ran the call, and its datums "
                        "came from an iterator, which cannot be sent twice; nothing was applied: send them "
                        "again"))) from None
                continue
            self._answer(seq_id)
            return response

    def _answer(self, seq_id: int) -> None:
        with self._lock:
            self._answered = max(self._answered, seq_id)

    def _before_sending_again(self, seq_id: int, exc: grpc.RpcError, deadline: float) -> None:
        """Returns when the call at seq_id should be sent again; raises when it must not be."""
        with self._lock:
            answered = self._answered  # before asking: calls answered later may lie past what the trainer says
        session = session_when_reachable(self._stub, self._md, self.model_id, deadline)
        expected = session.next_seq_id
        if answered >= expected:
            raise TrainyardError("ABORTED", (
                f"session '{self.model_id}' is at seq_id {expected} (optimizer step {session.optim_steps}) but the "
                f"client has answers up to seq_id {answered}: a trainer restart took the session back to its last "
                f"recorded state and those calls were lost (ServiceClient.resume_training_client({self.model_id!r}) "
                "goes on from there)"))
        if seq_id < expected:
            self._answer(seq_id)
            raise SessionUnchanged(TrainyardError("UNAVAILABLE", (
                f"{exc.details()} (the trainer had taken seq_id {seq_id}: the session holds whatever the call "
                "did, and goes on)")))

    def _skip(self, seq_id: int) -> None:
        """Use up a reserved seq_id without touching the session: a ForwardBackward with no datums is bad input,
        which the trainer refuses (INVALID_ARGUMENT) in its turn, changing nothing; later calls then do not wait for
        it. If the trainer cannot be told, the seq_id stays open and this client refuses later calls."""
        try:
            self._ordered("ForwardBackward", tpb.ForwardBackwardRequest(session_id=self.model_id, seq_id=seq_id,
                                                                        loss_fn="cross_entropy"))
        except grpc.RpcError as exc:
            if exc.code() not in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                self._fail(f"seq_id {seq_id} could not be used up ({exc.code().name}: {exc.details()})")
        except (TrainyardError, SessionUnchanged) as exc:
            self._fail(f"seq_id {seq_id} could not be used up ({exc})")
