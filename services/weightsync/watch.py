"""WatchLineage for every client of the process: one poller thread, no thread per watcher.

A watcher gets its lineage's state when it starts, then again whenever the lineage's current version changes (a
publish, a rollback). One thread polls the database every poll_s for all watched lineages at once (one query for
their current versions; the full state is read only for a lineage that changed, once whatever its number of
watchers) and offers the new state to each of its watchers that has not seen it.

A watch is a blocking generator, served by the asyncio runner (services/common/aioserver.py): when it has nothing
to send it yields calls.Wait, and the server waits on its event loop until the poller offers a state, holding no
thread; it also wakes every heartbeat_s, so the call's interceptor and is_active() look at an idle stream. Each
account may hold max_per_account watchers. When the service stops every stream ends; a failed poll ends the streams
with its error (clients reconnect).
"""
from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator

from services.common.calls import Wait
from services.common.quotas import check_quota
from services.weightsync.store import WeightStore

_END = object()


def _marker(state) -> tuple:
    row = state[0]
    return row.current_version_id, row.updated_at


class _Watcher:
    def __init__(self, seen: tuple):
        self.seen = seen  # the poller's to read and write
        self._lock = threading.Lock()
        self._pending = None  # the newest state not yet sent, an exception, or _END
        self._wake: list[Callable[[], None]] = []

    def offer(self, item) -> None:
        with self._lock:
            self._pending = item
            wake, self._wake = self._wake, []
        for fn in wake:
            fn()

    def take(self):
        with self._lock:
            item, self._pending = self._pending, None
            return item

    def on_ready(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._pending is None:
                self._wake.append(fn)
                return
        fn()


class LineageWatchers:
    def __init__(self, store: WeightStore, poll_s: float, heartbeat_s: float, stopping: threading.Event,
                 max_per_account: int):
        self.store = store
        self.poll_s, self.heartbeat_s = poll_s, heartbeat_s
        self.stopping = stopping
        self.max_per_account = max_per_account
        self._lock = threading.Lock()
        self._watchers: dict[tuple[str, str], set[_Watcher]] = {}  # (account, lineage) -> its watchers
        self._per_account: Counter[str] = Counter()
        self._poller: threading.Thread | None = None

    def count(self, account_id: str) -> int:
        with self._lock:
            return self._per_account[account_id]

    def watch(self, account_id: str, lineage: str, is_active: Callable[[], bool]) -> Iterator:
        """(lineage row, current version, newest version number) now, then on every change; Wait in between. Ends
        when is_active() turns False or the service stops."""
        with self._lock:
            check_quota("max_watches_per_account", self.max_per_account, self._per_account[account_id],
                        "the account has that many WatchLineage streams open on the weight-sync service")
            self._per_account[account_id] += 1
        key, watcher = (account_id, lineage), None
        try:
            state = self.store.lineage(account_id, lineage)  # NOT_FOUND: not the account's lineage
            watcher = _Watcher(_marker(state))
            with self._lock:
                self._watchers.setdefault(key, set()).add(watcher)
                if self._poller is None:
                    self._poller = threading.Thread(target=self._poll, daemon=True, name="weightsync-watch")
                    self._poller.start()
            while is_active() and not self.stopping.is_set():
                if isinstance(state, Exception):
                    raise state
                if state is _END:
                    return
                yield state if state is not None else Wait(watcher.on_ready, self.heartbeat_s)
                state = watcher.take()
        finally:
            with self._lock:
                self._per_account[account_id] -= 1
                if not self._per_account[account_id]:
                    del self._per_account[account_id]
                watchers = self._watchers.get(key, set())
                watchers.discard(watcher)
                if not watchers:
                    self._watchers.pop(key, None)

    def _poll(self) -> None:
        """One thread for every watcher, while there are any."""
        while not self.stopping.wait(self.poll_s):
            with self._lock:
                keys = list(self._watchers)
                if not keys:
                    self._poller = None
                    return
            try:
                markers = self.store.lineage_markers(keys)
                changed = {k: self.store.lineage(*k) for k in keys
                           if any(w.seen != markers.get(k) for w in self._of(k))}
            except Exception as exc:  # noqa: BLE001 - every stream ends with it (e.g. UNAVAILABLE: database down)
                self._offer_all(exc)
                continue
            for key, state in changed.items():
                for watcher in self._of(key):
                    if watcher.seen != _marker(state):
                        watcher.seen = _marker(state)
                        watcher.offer(state)
        self._offer_all(_END)

    def _of(self, key: tuple[str, str]) -> list[_Watcher]:
        with self._lock:
            return list(self._watchers.get(key, ()))

    def _offer_all(self, item) -> None:
        with self._lock:
            watchers = [w for ws in self._watchers.values() for w in ws]
        for watcher in watchers:
            watcher.offer(item)
