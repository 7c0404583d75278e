"""The dashboard's access to the platform: the sidebar connection, cached SDK clients, errors.

Every server call goes through `trainyard.Client`; a `TrainyardError` is shown with `show_error` (code, message and
the field or row violations as a table), never as a traceback.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass

import pandas as pd
import streamlit as st

from dashboard.logic import md_escape
from trainyard import Client, TrainyardError
from trainyard.config import DEFAULT_ROLLOUT_URL, DEFAULT_URL

CONNECTION = "connection"  # session-state key of the current Connection
SAVED_CONNECTION = "saved_connection"  # session-state key of the sidebar's field values
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


def sidebar_connection() -> Connection:
    """Connection fields in the sidebar (prefilled from TRAINYARD_URL, TRAINYARD_ROLLOUT_URL, TRAINYARD_API_KEY)."""
    defaults = {"conn_url": os.environ.get("TRAINYARD_URL") or DEFAULT_URL,
                "conn_rollout_url": os.environ.get("TRAINYARD_ROLLOUT_URL") or DEFAULT_ROLLOUT_URL,
                "conn_api_key": os.environ.get("TRAINYARD_API_KEY", "")}
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
        st.session_state[SAVED_CONNECTION] = {"conn_url": url, "conn_rollout_url": rollout_url, "conn_api_key": api_key}
        conn = connect(url, rollout_url, api_key)
        if conn.account:
            st.success(f"Signed in as **{md_escape(conn.account)}**")
        elif not api_key.strip():
            st.warning(md_escape(conn.problem))
        else:
            st.error(md_escape(conn.problem))
    st.session_state[CONNECTION] = conn
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
