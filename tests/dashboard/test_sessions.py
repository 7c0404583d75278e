"""Dashboard sign-in sessions (dashboard/sessions.py): the store, and the sidebar's typed-key flow through AppTest."""
from __future__ import annotations

import json
import os
import time

import pytest

from dashboard.sessions import SessionStore


def test_store_keeps_hashed_tokens_owner_only_and_ends_idle_sessions(tmp_path):
    path = tmp_path / "s.json"
    store = SessionStore(path, idle_s=60)
    token = store.create("127.0.0.1:1", "127.0.0.1:2", "ty_secret", "alice")
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    raw = json.loads(path.read_text())
    assert token not in path.read_text() and len(raw) == 1  # only the token's sha256 is stored
    got = store.get(token)
    assert (got.account, got.api_key, got.url) == ("alice", "ty_secret", "127.0.0.1:1")
    assert store.get("not-a-token") is None and store.get(None) is None
    other = store.create("u", "r", "ty_other", "bob")
    store.delete(token)
    assert store.get(token) is None and store.get(other).account == "bob"
    assert store.delete_key("ty_other") == 1 and store.get(other) is None

    stale = SessionStore(path, idle_s=0.05)
    t = stale.create("u", "r", "k", "carol")
    time.sleep(0.1)
    assert stale.get(t) is None and json.loads(path.read_text()) == {}


def test_damaged_store_signs_out_instead_of_failing(tmp_path):
    path = tmp_path / "s.json"
    path.write_text("{not json")
    store = SessionStore(path)
    assert store.get("x") is None
    token = store.create("u", "r", "k", "dave")  # rewritten whole
    assert store.get(token).account == "dave"


@pytest.mark.integration
def test_typed_key_starts_a_session_and_leaves_the_page(stack, monkeypatch, tmp_path):
    from streamlit.testing.v1 import AppTest

    from dashboard import api
    from tests.conftest import create_account
    from trainyard.localstack import ROOT

    key = create_account(stack.env_for("scheduler"), "dashboard-session")
    monkeypatch.setenv("TRAINYARD_URL", stack.url("scheduler"))
    monkeypatch.setenv("TRAINYARD_ROLLOUT_URL", stack.url("rollout"))
    monkeypatch.delenv("TRAINYARD_API_KEY", raising=False)
    monkeypatch.setenv("TRAINYARD_DASHBOARD_SESSIONS", str(tmp_path / "sessions.json"))
    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=120).run()
    at.sidebar.text_input(key="conn_api_key").set_value(key).run()
    assert not at.exception, [e.value for e in at.exception]
    assert "Signed in as **dashboard-session**" in " ".join(e.value for e in at.sidebar.success)
    assert [b.label for b in at.sidebar.button] == ["Sign out"]
    assert "conn_api_key" not in at.session_state and key not in json.dumps(at.session_state[api.SAVED_CONNECTION])
    token = at.session_state[api.SESSION_TOKEN]

    # Another browser session that presents the token (a reload sends it as the cookie) is signed in.
    again = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=120)
    again.session_state[api.SESSION_TOKEN] = token
    again.run()
    assert "Signed in as **dashboard-session**" in " ".join(e.value for e in again.sidebar.success)

    again.sidebar.button[0].click().run()  # Sign out
    assert "Enter your API key" in " ".join(e.value for e in again.sidebar.warning)
    assert SessionStore(tmp_path / "sessions.json").get(token) is None


@pytest.mark.integration
def test_the_next_account_in_a_tab_sees_nothing_of_the_previous_ones_pages(stack, monkeypatch, tmp_path):
    """What one account's pages left in the tab's state (the last upload's preview, chats, "Try it" answers, the job
    picked) is gone when it signs out, and when another account's session takes the tab over."""
    from streamlit.testing.v1 import AppTest

    from dashboard import api
    from tests.conftest import create_account
    from trainyard.localstack import ROOT

    keys = {name: create_account(stack.env_for("scheduler"), name) for name in ("tab-alice", "tab-bob")}
    monkeypatch.setenv("TRAINYARD_URL", stack.url("scheduler"))
    monkeypatch.setenv("TRAINYARD_ROLLOUT_URL", stack.url("rollout"))
    monkeypatch.delenv("TRAINYARD_API_KEY", raising=False)
    monkeypatch.setenv("TRAINYARD_DASHBOARD_SESSIONS", str(tmp_path / "sessions.json"))
    store = SessionStore(tmp_path / "sessions.json")
    left_behind = {"last_upload": {"rows": [{"secret": "alice's row"}]}, "deployment_tried": {"dep_1": "answer"},
                   "job_id": "job_alice", "chat-base:tiny-qwen3": [{"role": "user", "content": "alice asks"}]}

    def signed_in_as(at) -> str:
        return " ".join(e.value for e in at.sidebar.success)

    at = AppTest.from_file(str(ROOT / "dashboard" / "app.py"), default_timeout=120).run()
    at.sidebar.text_input(key="conn_api_key").set_value(keys["tab-alice"]).run()
    assert "tab-alice" in signed_in_as(at)
    for k, v in left_behind.items():
        at.session_state[k] = v
    at.run()
    assert all(k in at.session_state for k in left_behind)  # her own pages keep it while she is signed in

    at.sidebar.button[0].click().run()  # Sign out
    assert not [k for k in left_behind if k in at.session_state]
    at.sidebar.text_input(key="conn_api_key").set_value(keys["tab-bob"]).run()
    assert "tab-bob" in signed_in_as(at) and not [k for k in left_behind if k in at.session_state]

    # Without signing out: another account's session presented in the same tab (its cookie) starts from nothing.
    for k, v in left_behind.items():
        at.session_state[k] = v
    at.session_state[api.SESSION_TOKEN] = store.create(stack.url("scheduler"), stack.url("rollout"),
                                                       keys["tab-alice"], "tab-alice")
    at.run()
    assert "tab-alice" in signed_in_as(at) and not [k for k in left_behind if k in at.session_state]
