"""AppTest helpers the dashboard's page tests share (the browser tests' are in browser.py)."""
from __future__ import annotations

from streamlit.testing.v1 import AppTest

from tests.conftest import ROOT

APP = str(ROOT / "dashboard" / "app.py")


def open_app(page: str | None = None, timeout_s: float = 120, **state) -> AppTest:
    """The app run once with the given session state, then switched to page (None: the default page)."""
    at = AppTest.from_file(APP, default_timeout=timeout_s)
    for k, v in state.items():
        at.session_state[k] = v
    at.run()
    if page:
        at.switch_page(page).run()
    assert_no_exception(at)
    return at


def assert_no_exception(at: AppTest) -> None:
    assert not at.exception, [e.value for e in at.exception]


def text(elements) -> str:
    """The visible text of markdown-ish elements (bold marks and markdown escapes removed)."""
    return "\n".join(str(e.value) for e in elements).replace("**", "").replace("\\", "")


def button(at: AppTest, label: str, key: str | None = None):
    """The button with this key, else the first whose label starts with label."""
    return at.button(key=key) if key else next(b for b in at.button if b.label.startswith(label))


def widget(widgets, label: str):
    return next(w for w in widgets if w.label == label)


def number(at: AppTest, label: str):
    return widget(at.number_input, label)
