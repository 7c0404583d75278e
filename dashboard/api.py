"""The dashboard's access to the platform: the sidebar connection, cached SDK clients, errors.

Every server call goes through `trainyard.Client`; a `TrainyardError` is shown with `show_error` (code, message and
the field or row violations as a table), never as a traceback.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import streamlit as st

from dashboard.logic import field_labels, float_step, list_value, md_escape, place_violations
from dashboard.sessions import COOKIE, SESSION_IDLE_S, SessionStore, store_path
from trainyard import Client, TrainyardError
from trainyard.config import DEFAULT_ROLLOUT_URL, DEFAULT_URL
from trainyard.methods.spec import Field, format_value

CONNECTION = "connection"  # session-state key of the current Connection
SAVED_CONNECTION = "saved_connection"  # session-state key of the sidebar's field values
SESSION_TOKEN = "session_token"  # this tab's sign-in session (dashboard/sessions.py), until its cookie is read back
PENDING_COOKIE = "session_cookie_pending"  # the session's cookie is still to be set in the browser
SIGNED_OUT = "signed_out"  # "Sign out" was pressed: the cookie is cleared on the next run
OWNER = "state_owner"  # (scheduler URL, account) whose pages filled this tab's page state
# Page state that is the sign-in's own, kept when the account changes; everything else (previews, chats, test results,
# archives, selections) belongs to the account that made it and is forgotten at sign-out or a change of account.
_CONNECTION_STATE = {"conn_url", "conn_rollout_url", "conn_api_key"}
CLIENT_TIMEOUT_S = 20.0  # unary calls; uploads, deployments and sampling carry their own longer deadlines

HEADLINES = {
    "UNAVAILABLE": "Cannot reach the server",
    "UNAUTHENTICATED": "The API key was not accepted",
    "PERMISSION_DENIED": "Not allowed",
    "INVALID_ARGUMENT": "The server rejected the request",
    "NOT_FOUND": "Not found",
    "ALREADY_EXISTS": "Already exists",
    "FAILED_PRECONDITION": "Not possible right now",
    "RESOURCE_EXHAUSTED": "Out of capacity",
    "DEADLINE_EXCEEDED": "The server took too long to answer",
}
_ROW_FIELD = re.compile(r"row (\d+): (.*)")


@dataclass(frozen=True)
class Connection:
    url: str
    rollout_url: str
    api_key: str
    account: str = ""  # the signed-in account's name; empty when not connected
    problem: str = ""  # why not connected


@st.cache_resource(max_entries=16, show_spinner=False)
def get_client(url: str, rollout_url: str, api_key: str) -> Client:
    return Client(url=url, rollout_url=rollout_url, api_key=api_key, timeout_s=CLIENT_TIMEOUT_S)


def connect(url: str, rollout_url: str, api_key: str) -> Connection:
    """Check the key with WhoAmI; the returned Connection says who is signed in or what is wrong, in words."""
    url, rollout_url, api_key = url.strip(), rollout_url.strip(), api_key.strip()
    if not api_key:
        return Connection(url, rollout_url, api_key, problem="Enter your API key to sign in (an operator creates one "
                          "with: trainyard admin create-account NAME).")
    if not url:
        return Connection(url, rollout_url, api_key, problem="Enter the scheduler URL (host:port).")
    try:
        account = get_client(url, rollout_url, api_key).whoami()
    except TrainyardError as exc:
        if exc.code == "UNAUTHENTICATED":
            problem = f"The API key was not accepted by the scheduler at {url}: {exc.message}"
        elif exc.code == "UNAVAILABLE":
            problem = f"Cannot reach the scheduler at {url}. Check the URL and that the scheduler is running."
        else:
            problem = f"{exc.code}: {exc.message}"
        return Connection(url, rollout_url, api_key, problem=problem)
    return Connection(url, rollout_url, api_key, account=account.name)


@st.cache_resource(show_spinner=False)
def _session_store(path: str) -> SessionStore:
    return SessionStore(Path(path))


def session_store() -> SessionStore:
    return _session_store(str(store_path()))


def _set_cookie(token: str | None) -> None:
    """Set (or, with None, delete) the session cookie in the browser: a script in the page, since Streamlit reads
    cookies (st.context.cookies) but has no call to write them."""
    value, age = (token, SESSION_IDLE_S) if token is not None else ("", 0)
    st.html("<script>const secure = window.location.protocol === 'https:' ? '; Secure' : '';"
            f"document.cookie = '{COOKIE}={value}; Path=/; Max-Age={age}; SameSite=Strict' + secure;</script>",
            unsafe_allow_javascript=True)


def _session_token() -> str | None:
    token = st.session_state.get(SESSION_TOKEN) or st.context.cookies.get(COOKIE)
    return token if isinstance(token, str) else None  # (AppTest's context has no real cookies)


def _forget_page_state() -> None:
    """Drop every page's state (the last upload's preview, chats, evaluator results, export archives, the job
    picked...): it belongs to the account that was signed in, and the next one in this tab must not see it."""
    keep = _CONNECTION_STATE | {SAVED_CONNECTION, SESSION_TOKEN, PENDING_COOKIE, SIGNED_OUT}
    for key in [k for k in st.session_state if k not in keep]:
        del st.session_state[key]


def _own_page_state(conn: Connection) -> None:
    """Page state is the signed-in account's: when another account signs in in this tab, start from nothing. (A tab's
    first sign-in keeps what is there: nobody's pages ran before it, and Sign out has already forgotten the rest.)"""
    owner = [conn.url, conn.account]
    previous = st.session_state.get(OWNER)
    if previous is not None and previous != owner:
        _forget_page_state()
    st.session_state[OWNER] = owner


def sign_out() -> None:
    session_store().delete(_session_token())
    _forget_page_state()
    st.session_state.pop(SESSION_TOKEN, None)
    st.session_state[SIGNED_OUT] = True  # this tab's cookie is cleared on the next run
    st.session_state[SAVED_CONNECTION] = {**st.session_state.get(SAVED_CONNECTION, {}), "conn_api_key": ""}
    st.session_state["conn_api_key"] = ""


def _signed_in_sidebar(conn: Connection) -> None:
    with st.sidebar:
        st.subheader("Connection")
        st.success(f"Signed in as **{md_escape(conn.account)}**")
        st.caption(f"scheduler {md_escape(conn.url)} · rollout {md_escape(conn.rollout_url)}")
        st.button("Sign out", key="sign_out", on_click=sign_out)


def sidebar_connection() -> Connection:
    """The signed-in connection: from this browser's session (sessions.py) when it has one, else from the sidebar's
    fields (prefilled from TRAINYARD_URL, TRAINYARD_ROLLOUT_URL, TRAINYARD_API_KEY). A key typed in and accepted
    starts a session, so a reload stays signed in; a key from the environment signs in on every run without one."""
    store = session_store()
    if st.session_state.pop(SIGNED_OUT, False):
        _set_cookie(None)
        token = None
    else:
        token = _session_token()
    signin = store.get(token) if token else None
    if signin is not None:
        conn = connect(signin.url, signin.rollout_url, signin.api_key)
        if conn.account:
            if st.session_state.pop(PENDING_COOKIE, None):
                _set_cookie(token)
            _own_page_state(conn)
            _signed_in_sidebar(conn)
            st.session_state[CONNECTION] = conn
            return conn
        if conn.problem.startswith("The API key was not accepted"):
            store.delete_key(signin.api_key)  # revoked: every session of the key ends
            _set_cookie(None)
    env_key = os.environ.get("TRAINYARD_API_KEY", "")
    defaults = {"conn_url": os.environ.get("TRAINYARD_URL") or DEFAULT_URL,
                "conn_rollout_url": os.environ.get("TRAINYARD_ROLLOUT_URL") or DEFAULT_ROLLOUT_URL,
                "conn_api_key": env_key}
    # A run started by st.switch_page (Streamlit 1.67) begins without these widgets' state, so they would come back
    # empty or at the env defaults: restore what the user typed from a plain session-state copy.
    saved = st.session_state.get(SAVED_CONNECTION, {})
    for key, default in defaults.items():
        if key not in st.session_state:
            st.session_state[key] = saved.get(key, default)
    with st.sidebar:
        st.subheader("Connection")
        url = st.text_input("Scheduler URL", key="conn_url")
        rollout_url = st.text_input("Rollout URL", key="conn_rollout_url")
        api_key = st.text_input("API key", type="password", key="conn_api_key")
        conn = connect(url, rollout_url, api_key)
        typed = conn.account and api_key.strip() != env_key.strip()
        # The key stays in page state only until a session holds it.
        st.session_state[SAVED_CONNECTION] = {"conn_url": url, "conn_rollout_url": rollout_url,
                                              "conn_api_key": "" if typed else api_key}
        if conn.account:
            st.success(f"Signed in as **{md_escape(conn.account)}**")
        elif not api_key.strip():
            st.warning(md_escape(conn.problem))
        else:
            st.error(md_escape(conn.problem))
    if conn.account:
        _own_page_state(conn)
    st.session_state[CONNECTION] = conn
    if typed:
        token = store.create(conn.url, conn.rollout_url, conn.api_key, conn.account)
        st.session_state[SESSION_TOKEN] = token
        st.session_state[PENDING_COOKIE] = True
        del st.session_state["conn_api_key"]
        st.rerun()
    return conn


def require_client() -> Client:
    """The signed-in client for a page; without one, say how to connect and stop the page here."""
    conn: Connection | None = st.session_state.get(CONNECTION)
    if conn is None or not conn.account:
        st.info("Not signed in: check the scheduler URL and your API key in the sidebar.")
        st.stop()
    return get_client(conn.url, conn.rollout_url, conn.api_key)


# -- errors ------------------------------------------------------------------------------------------------------
def violations_frame(violations, labels: dict[str, str] | None = None) -> pd.DataFrame:
    """(row, field, reason) rows from SDK FieldErrors (the server writes a row-level field as 'row N: path').

    The row column is left out when no violation names a row; labels (request field -> input label) add a column.
    """
    out = []
    for v in violations:
        m = _ROW_FIELD.fullmatch(v.field)
        row, fld = (m.group(1), m.group(2)) if m else ("", v.field)
        out.append({"setting": (labels or {}).get(fld, ""), "row": row, "field": fld, "reason": v.reason})
    frame = pd.DataFrame(out, columns=["setting", "row", "field", "reason"])
    return frame.drop(columns=[c for c in ("setting", "row") if not frame[c].any()])


def show_error(exc: TrainyardError, labels: dict[str, str] | None = None) -> None:
    """A server error in words: headline, code, message, and a table of the violations if there are any."""
    headline = HEADLINES.get(exc.code, "The server reported an error")
    st.error(f"**{headline}** ({exc.code}): {md_escape(exc.message)}")
    if exc.violations:
        st.table(violations_frame(exc.violations, labels), hide_index=True)


# -- a declared setting as an input ------------------------------------------------------------------------------
def setting_input(container, f: Field, value, key: str):
    """The input of one declared setting (trainyard/methods/), prefilled with value (the declared default, or a
    job's own setting when it is cloned); returns the value to send, None for one left unset."""
    s, label, helptext = f.setting, f.setting.label, f.describe()
    if s.choices:
        return container.selectbox(label, s.choices, index=s.choices.index(value), help=helptext, key=key)
    if f.type is bool and f.default is None:  # unset: the method decides (e.g. dynamic sampling for dapo only)
        options = ("default", "on", "off")
        choice = container.selectbox(label, options, index={None: 0, True: 1, False: 2}[value], help=helptext,
                                     key=key)
        return {"default": None, "on": True, "off": False}[choice]
    if f.type is bool:
        return container.checkbox(label, value=bool(value), help=helptext, key=key)
    if f.is_list:
        text = container.text_input(label, value=format_value(value or ()), help=helptext, placeholder="default",
                                    key=key)
        return list_value(text)
    if f.type is str:  # e.g. an evaluator reference; empty: left unset
        return container.text_input(label, value=value or "", help=helptext, key=key).strip() or None
    if f.type is int:
        got = container.number_input(label, value=value, step=1, help=helptext, placeholder="unset", key=key)
        return None if got is None else int(got)
    if value is None:
        got = container.number_input(label, value=None, format="%g", help=helptext, placeholder="unset", key=key)
        return None if got is None else float(got)
    return float(container.number_input(label, value=float(value), step=float_step(f.default or value),
                                        format="%g", help=helptext, key=key))


def show_error_at_inputs(exc: TrainyardError, method, slots, what: str = "Not done") -> None:
    """A refused form, each error once: the violations of the inputs in slots (setting name -> st.empty) under
    them, and the error with the violations no input shows above the button; for another code, the error alone."""
    if exc.code != "INVALID_ARGUMENT":
        show_error(exc)
        return
    placed, rest = place_violations(exc.violations, method, slots)
    for name, reasons in placed.items():
        slots[name].error("\n\n".join(md_escape(r) for r in reasons))
    if not rest:
        st.error(f"**{what}**: fix the settings marked above.")
    else:
        show_error(TrainyardError(exc.code, exc.message, list(rest)), field_labels(method))
