"""WatchLineage for every client of the process, on the server's event loop: one poller, no thread per watcher.

A watcher gets its lineage's state when it starts, then again whenever the lineage's current version changes (a
publish, a rollback). One task polls the database every watch_poll_s for all watched lineages at once (one query for
their current versions; the full state is read only for a lineage that changed, once whatever its number of
watchers) and hands the new state to each of its watchers that has not seen it. A watcher costs a queue on the loop;
the queries run in the server's thread pool (the loop's default executor). Each account may hold
max_watches_per_account watchers. When the service stops every stream ends; a failed poll ends the streams with its
error (clients reconnect).
"""
from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from services.common.quotas import check_quota
from services.weightsync.store import WeightStore


def _marker(state) -> tuple:
    row = state[0]
    return row.current_version_id, row.updated_at


@dataclass(eq=False)
class _Watcher:
    seen: tuple = ()
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # states, an exception, or None: the end


class LineageWatchers:
    def __init__(self, store: WeightStore, poll_s: float, stopping: threading.Event, max_per_account: int):
        self.store = store
        self.poll_s = poll_s
        self.stopping = stopping
        self.max_per_account = max_per_account
        self._watchers: dict[tuple[str, str], set[_Watcher]] = {}  # (account, lineage) -> its watchers
        self._per_account: Counter[str] = Counter()
        self._poller: asyncio.Task | None = None

    def count(self, account_id: str) -> int:
        return self._per_account[account_id]

    async def watch(self, account_id: str, lineage: str) -> AsyncIterator[tuple]:
        """(lineage row, current version, newest version number) now, then on every change."""
        check_quota("max_watches_per_account", self.max_per_account, self._per_account[account_id],
                    "the account has that many WatchLineage streams open on the weight-sync service")
        self._per_account[account_id] += 1
        key, watcher = (account_id, lineage), _Watcher()
        try:
            state = await asyncio.to_thread(self.store.lineage, account_id, lineage)  # NOT_FOUND: not the account's
            watcher.seen = _marker(state)
            self._watchers.setdefault(key, set()).add(watcher)
            if self._poller is None or self._poller.done():
                self._poller = asyncio.create_task(self._poll())
            while state is not None:
                if isinstance(state, Exception):
                    raise state
                yield state
                state = await watcher.queue.get()
        finally:
            self._per_account[account_id] -= 1
            if not self._per_account[account_id]:
                del self._per_account[account_id]
            watchers = self._watchers.get(key, set())
            watchers.discard(watcher)
            if not watchers:
                self._watchers.pop(key, None)

    async def _poll(self) -> None:
        while self._watchers:
            await asyncio.sleep(self.poll_s)
            if self.stopping.is_set():
                self._tell_all(None)
                return
            keys = list(self._watchers)
            try:
                markers = await asyncio.to_thread(self.store.lineage_markers, keys)
                changed = [k for k in keys if any(w.seen != markers.get(k) for w in self._watchers.get(k, ()))]
                states = await asyncio.to_thread(lambda: {k: self.store.lineage(*k) for k in changed})
            except Exception as exc:  # noqa: BLE001 - every stream ends with it (e.g. UNAVAILABLE: database down)
                self._tell_all(exc)
                return
            for key, state in states.items():
                for watcher in self._watchers.get(key, ()):
                    if watcher.seen != _marker(state):
                        watcher.seen = _marker(state)
                        watcher.queue.put_nowait(state)

    def _tell_all(self, item) -> None:
        for watchers in self._watchers.values():
            for watcher in watchers:
                watcher.queue.put_nowait(item)
