"""Strictly ordered calls on a Training API session (services/trainer/sessions.py documents the contract).

A call waits, under the session's condition, until the session's next seq_id is its own and no call holds the turn;
it then computes outside the lock holding the turn (`running`), and hands the turn to seq_id + 1 when it ends,
whatever its outcome. The wait ends early when the call's client leaves (its Cancellation), without using the seq_id.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from services.common.calls import Cancellation
from services.common.errors import Cancelled, FailedPrecondition, InvalidArgument, TrainyardError

T = TypeVar("T")


def run_in_order(sess, seq_id: int, fn: Callable[[], T], cancel: Cancellation, timeout_s: float) -> T:
    """fn() in seq_id's turn on sess (a Session: id, cond, next_seq_id, running, closed, error). seq_id 0 takes the
    first seq_id not yet taken. Bad input (a TrainyardError) fails the call alone; any other failure marks the
    session failed, and later calls get FAILED_PRECONDITION."""

    def wake() -> None:  # the client left: the wait below returns
        with sess.cond:
            sess.cond.notify_all()

    cancel.add_callback(wake)
    with sess.cond:
        first_free = sess.next_seq_id + sess.running
        if seq_id == 0:
            seq_id = first_free
        if seq_id < first_free:
            raise InvalidArgument(f"seq_id {seq_id} was already used; the session expects {first_free}",
                                  field="seq_id")
        turn = sess.cond.wait_for(lambda: (sess.next_seq_id == seq_id and not sess.running) or sess.closed
                                  or cancel.cancelled, timeout_s)
        if cancel.cancelled:
            raise Cancelled(f"the client left before seq_id {seq_id}'s turn; the seq_id was not used")
        if not turn:
            raise FailedPrecondition(f"seq_id {seq_id} waited {timeout_s:.0f}s for seq_id {sess.next_seq_id}, "
                                     "which never arrived")
        if sess.closed:
            raise FailedPrecondition(f"session '{sess.id}' is closed")
        sess.running = True
    try:
        if sess.error:
            raise FailedPrecondition(f"session '{sess.id}' failed earlier ({sess.error}); create a new one")
        return fn()
    except TrainyardError:
        raise
    except Exception as exc:
        sess.error = f"seq_id {seq_id}: {type(exc).__name__}: {exc}"
        raise
    finally:
        with sess.cond:
            sess.next_seq_id = seq_id + 1
            sess.running = False
            sess.cond.notify_all()
