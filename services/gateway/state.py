"""The gateway's in-memory state, every piece owned by one account (another account's id is simply not found):
futures, idempotency keys, client sessions, models (trainer sessions) and sampling sessions.

Futures. A request that does work (create_model, forward_backward, asample, ...) is answered at once with a
request_id; the work runs as an asyncio task and its result waits for retrieve_future. An account holds at most
max_pending_futures_per_account futures not yet retrieved; more are refused with 429. A finished future is kept
future_ttl_s (a retrieve within that time answers it again), then forgotten: retrieving it answers 410 (the SDK then
sends the original request again).

Order. Tinker numbers each model's training requests (seq_id, from 1) and expects them run in that order, each once;
the trainyard SDK's TrainingClient numbers its calls itself, in the order they are made. A model's Sequencer makes
each call at its seq_id's turn (a request that arrives before its predecessor waits in its future), so both orders
agree; a request refused before its turn (400) gives its turn up. A model attached after a gateway restart has no
known next seq_id: it starts at the lowest one arriving within RESUME_GRACE_S of its first request.

Idempotency. A POST carrying X-Idempotency-Key (the SDK sends one per request, the same on each retry) is run once
per (account, path, key): a retry, concurrent or later, gets the first one's answer.
"""
from __future__ import annotations

import asyncio
import secrets
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from services.gateway.errors import GatewayError, classify

# A finished future's answer: (JSON-able object or protobuf bytes, media type).
Rendered = Callable[[bool], tuple[Any, str]]


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(12)}"


@dataclass
class Future:
    account_id: str
    task: asyncio.Task | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    render: Rendered | None = None  # set on success
    error: GatewayError | None = None  # set on failure
    finished_at: float = 0.0
    retrieved: bool = False


class Futures:
    def __init__(self, max_pending: int, ttl_s: float):
        self.max_pending, self.ttl_s = max_pending, ttl_s
        self._futures: dict[str, Future] = {}
        self._expired: dict[str, tuple[str, float]] = {}  # request id -> (account id, when it expired)

    def pending(self, account_id: str) -> int:
        return sum(1 for f in self._futures.values() if f.account_id == account_id and not f.retrieved)

    def check_room(self, account_id: str) -> None:
        self.expire()
        if self.pending(account_id) >= self.max_pending:
            raise GatewayError("RESOURCE_EXHAUSTED", f"this account has {self.max_pending} futures not yet retrieved "
                               "(max_pending_futures_per_account); retrieve some first", retry_after_s=1)

    def submit(self, account_id: str, work: Awaitable[Rendered], request_id: str | None = None,
               on_done: Callable[[str, Future], None] | None = None) -> str:
        """A new future of work (a coroutine returning the result's renderer); its request id. on_done(request id,
        future) runs once it finished."""
        try:
            self.check_room(account_id)
        except GatewayError:
            work.close()  # never started
            raise
        request_id = request_id or new_id("req")
        fut = Future(account_id)
        self._futures[request_id] = fut
        fut.task = asyncio.create_task(self._run(fut, work))
        if on_done is not None:
            fut.task.add_done_callback(lambda _: on_done(request_id, fut))
        return request_id

    async def _run(self, fut: Future, work: Awaitable[Rendered]) -> None:
        try:
            fut.render = await work
        except asyncio.CancelledError:
            fut.error = GatewayError("CANCELLED", "the request was cancelled")
        except Exception as exc:  # noqa: BLE001 - a failure is the future's result (errors.py)
            fut.error = classify(exc)
        fut.finished_at = time.monotonic()
        fut.done.set()

    def get(self, account_id: str, request_id: str) -> Future:
        self.expire()
        fut = self._futures.get(request_id)
        if fut is not None and fut.account_id == account_id:
            return fut
        if self._expired.get(request_id, ("", 0))[0] == account_id:
            raise GatewayError("EXPIRED", f"request_id: the result of {request_id} expired (kept "
                               f"{self.ttl_s:g} s after it finished); send the request again", "request_id")
        raise GatewayError("NOT_FOUND", f"request_id: no future {request_id!r}", "request_id")

    def cancel(self, account_id: str, request_id: str) -> None:
        fut = self.get(account_id, request_id)
        if fut.task is not None and not fut.task.done():
            fut.task.cancel()

    def expire(self) -> None:
        now = time.monotonic()
        for request_id, fut in list(self._futures.items()):
            if fut.done.is_set() and now - fut.finished_at > self.ttl_s:
                del self._futures[request_id]
                self._expired[request_id] = (fut.account_id, now)
        for request_id, (_, at) in list(self._expired.items()):  # 410 for another ttl_s, then unknown (404)
            if now - at > self.ttl_s:
                del self._expired[request_id]


class Idempotency:
    def __init__(self, ttl_s: float):
        self.ttl_s = ttl_s
        self._answers: dict[tuple[str, str, str], tuple[asyncio.Future, float]] = {}

    async def once(self, account_id: str, path: str, key: str | None, run: Callable[[], Awaitable[Any]]) -> Any:
        """run()'s answer, computed once per key; a failed run is forgotten, so a retry runs again."""
        if not key:
            return await run()
        now = time.monotonic()
        for k, (_, at) in list(self._answers.items()):
            if now - at > self.ttl_s:
                del self._answers[k]
        slot = (account_id, path, key)
        if slot in self._answers:
            return await asyncio.shield(self._answers[slot][0])
        answer: asyncio.Future = asyncio.get_running_loop().create_future()
        self._answers[slot] = (answer, now)
        try:
            result = await run()
        except BaseException as exc:
            del self._answers[slot]
            answer.set_exception(exc)
            answer.exception()  # retrieved: a failure nobody else awaited is not an "unretrieved" error
            raise
        answer.set_result(result)
        return result


class Sequencer:
    """Runs a model's calls in seq_id order (see the module docstring)."""

    # A model attached after a gateway restart starts at the lowest seq_id that arrives within this long of the
    # first (the SDK sends a batch's chunks concurrently, its first chunk last).
    RESUME_GRACE_S = 0.5

    def __init__(self, next_seq_id: int | None):
        self.next = next_seq_id  # None: not known yet (a model resumed after a gateway restart)
        self._turn = asyncio.Condition()
        self._skipped: set[int] = set()
        self._arrived: set[int] = set()

    async def turn(self, seq_id: int, call: Callable[[], Any]) -> Any:
        """call() at seq_id's turn (after every lower seq_id's call was made); its result."""
        async with self._turn:
            if self.next is None:
                self._arrived.add(seq_id)
                if len(self._arrived) == 1:
                    asyncio.get_running_loop().create_task(self._settle())
                await self._turn.wait_for(lambda: self.next is not None)
            if seq_id < self.next:
                raise GatewayError("INVALID_ARGUMENT", f"seq_id: {seq_id} was already used (next is {self.next})",
                                   "seq_id")
            await self._turn.wait_for(lambda: self.next == seq_id)
            try:
                return call()
            finally:
                self._advance()

    async def skip(self, seq_id: int) -> None:
        """Give seq_id's turn up (its request was refused before it ran)."""
        async with self._turn:
            if self.next is not None and seq_id >= self.next:
                self._skipped.add(seq_id)
                if seq_id == self.next:
                    self._advance(step=False)

    async def _settle(self) -> None:
        await asyncio.sleep(self.RESUME_GRACE_S)
        async with self._turn:
            self.next = min(self._arrived)
            self._arrived.clear()
            self._turn.notify_all()

    def _advance(self, step: bool = True) -> None:
        if step:
            self.next += 1
        while self.next in self._skipped:
            self._skipped.discard(self.next)
            self.next += 1
        self._turn.notify_all()


@dataclass
class ClientSession:
    account_id: str
    created: float = field(default_factory=time.time)
    last_heartbeat: float = field(default_factory=time.time)
    finished: str = ""  # the finish reason once finished

    def heartbeat(self) -> None:
        self.last_heartbeat = time.time()


@dataclass
class Model:
    """A Tinker model: a trainer session driven by a trainyard TrainingClient."""
    account_id: str
    client: Any  # trainyard.TrainingClient
    sequencer: Sequencer
    session_id: str = ""  # the Tinker client session that created it ("" once resumed)


class CompletionLog:
    """The finished requests of one sampling session clone, in the order they finished: what retrieve_futures
    answers from a cursor (an index into this log; entries below the cursor a client sends were seen, and go)."""

    def __init__(self):
        self._base = 0  # the cursor of _entries[0]
        self._entries: list[dict] = []
        self._grew = asyncio.Event()

    def add(self, request_id: str, failed: bool) -> None:
        self._entries.append({"state": "failed" if failed else "finished", "request_id": request_id})
        self._grew.set()

    async def since(self, cursor: int, wait_s: float) -> tuple[list[dict], int]:
        """The entries from cursor on (waiting up to wait_s for one when there are none), and the next cursor."""
        seen = min(max(cursor - self._base, 0), len(self._entries))
        del self._entries[:seen]
        self._base += seen
        if not self._entries and wait_s > 0:
            self._grew.clear()
            try:
                await asyncio.wait_for(self._grew.wait(), wait_s)
            except asyncio.TimeoutError:
                pass
        return list(self._entries), self._base + len(self._entries)


@dataclass
class SamplingSession:
    account_id: str
    client: Any  # trainyard.SamplingClient
    base_model: str
    model_path: str | None  # the Tinker path it samples, None for a base model
    completions: dict[int, CompletionLog] = field(default_factory=dict)  # per clone (seq_id // 10**9)

    def log(self, clone: int) -> CompletionLog:
        return self.completions.setdefault(clone, CompletionLog())


class Registry:
    """Objects by id, each owned by one account: another account's id is not found."""

    def __init__(self, kind: str):
        self.kind = kind
        self._items: dict[str, Any] = {}
        self._lock = threading.Lock()

    def put(self, item_id: str, item: Any) -> None:
        with self._lock:
            self._items[item_id] = item

    def find(self, account_id: str, item_id: str) -> Any | None:
        with self._lock:
            item = self._items.get(item_id)
        return item if item is not None and item.account_id == account_id else None

    def get(self, account_id: str, item_id: str, field: str) -> Any:
        item = self.find(account_id, item_id)
        if item is None:
            raise GatewayError("NOT_FOUND", f"{field}: no {self.kind} {item_id!r}", field)
        return item

    def known(self, item_id: str) -> bool:
        with self._lock:
            return item_id in self._items

    def pop(self, item_id: str) -> Any | None:
        with self._lock:
            return self._items.pop(item_id, None)

    def owned_by(self, account_id: str) -> dict[str, Any]:
        with self._lock:
            return {k: v for k, v in self._items.items() if v.account_id == account_id}
