"""Dashboard sign-in sessions, kept on the server: a reload or a new tab of the same browser stays signed in.

Signing in with an API key creates a session: a random token goes to the browser as the cookie `trainyard_session`
(SameSite=Strict, 7 days, Secure over HTTPS), and this store maps the token's sha256 to the connection (scheduler
and rollout URLs, the key, the account). The key typed in leaves the sidebar's page state at sign-in; the tab keeps
the token (to find the session before the browser sends the cookie back) and the signed-in connection that its pages
use, both of them on the server (Streamlit's session state never goes to the browser). Each run reads the cookie
(st.context.cookies) and looks the session up. Signing out deletes the session here, the cookie in the browser and
every page's state; a tab taken over by another account's session starts from empty page state too
(api._own_page_state). A session unused for SESSION_IDLE_S ends.

The store is one JSON file (TRAINYARD_DASHBOARD_SESSIONS, default ~/.cache/trainyard/dashboard-sessions.json),
readable by its owner only: it holds API keys, as `trainyard login`'s file does. It is written atomically (a temporary
file renamed over it) under a lock, since Streamlit serves every browser session from threads of one process.
"""
from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

COOKIE = "trainyard_session"
SESSION_IDLE_S = 7 * 24 * 3600
_TOUCH_EVERY_S = 300  # last_used is rewritten at most this often per session


def store_path() -> Path:
    return Path(os.environ.get("TRAINYARD_DASHBOARD_SESSIONS")
                or Path.home() / ".cache" / "trainyard" / "dashboard-sessions.json")


@dataclass(frozen=True)
class SignIn:
    url: str
    rollout_url: str
    api_key: str
    account: str
    created: float
    last_used: float


class SessionStore:
    def __init__(self, path: Path | None = None, idle_s: float = SESSION_IDLE_S):
        self.path = path or store_path()
        self.idle_s = idle_s
        self._lock = threading.Lock()

    @staticmethod
    def _digest(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()

    def _read(self) -> dict[str, dict]:
        try:
            raw = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError):
            return {}  # a damaged file signs everyone out; it is rewritten whole on the next sign-in
        return raw if isinstance(raw, dict) else {}

    def _write(self, sessions: dict[str, dict]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.{threading.get_ident()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(sessions, f)
        os.replace(tmp, self.path)

    def _live(self, sessions: dict[str, dict], now: float) -> dict[str, dict]:
        return {k: v for k, v in sessions.items() if now - v.get("last_used", 0) < self.idle_s}

    def create(self, url: str, rollout_url: str, api_key: str, account: str) -> str:
        """A new session for a checked sign-in; returns the token for the cookie."""
        token = secrets.token_urlsafe(32)
        now = time.time()
        with self._lock:
            sessions = self._live(self._read(), now)
            sessions[self._digest(token)] = asdict(SignIn(url, rollout_url, api_key, account, now, now))
            self._write(sessions)
        return token

    def get(self, token: str | None) -> SignIn | None:
        if not token:
            return None
        now = time.time()
        digest = self._digest(token)
        with self._lock:
            sessions = self._read()
            found = sessions.get(digest)
            if found is None:
                return None
            if now - found.get("last_used", 0) >= self.idle_s:
                del sessions[digest]
                self._write(self._live(sessions, now))
                return None
            if now - found["last_used"] >= _TOUCH_EVERY_S:
                found["last_used"] = now
                self._write(self._live(sessions, now))
        return SignIn(**found)

    def delete(self, token: str | None) -> None:
        if not token:
            return
        with self._lock:
            sessions = self._read()
            if sessions.pop(self._digest(token), None) is not None:
                self._write(sessions)

    def delete_key(self, api_key: str) -> int:
        """End every session of a key (it was revoked or rejected); returns how many."""
        with self._lock:
            sessions = self._read()
            keep = {k: v for k, v in sessions.items() if v.get("api_key") != api_key}
            if len(keep) != len(sessions):
                self._write(keep)
            return len(sessions) - len(keep)
