"""Driving the dashboard in a real headless Chromium (Playwright, sync API): the browser, signing in, files, waiting
for Streamlit to settle, and screenshots small enough to commit."""
from __future__ import annotations

import contextlib
import io
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

CHROMIUM = Path("/usr/bin/chromium")
# Without the background-networking flags Chromium keeps calling home, which floods a closed network.
CHROMIUM_ARGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
TIMEOUT_MS = 60_000
VIEWPORT = {"width": 1280, "height": 800}
SCREENSHOTS = Path(__file__).resolve().parents[2] / "docs" / "screenshots"
BUSY = "!!document.querySelector('[data-stale=\"true\"], [data-testid=\"stStatusWidget\"]')"
UPDATE_SCREENSHOTS = "TRAINYARD_UPDATE_SCREENSHOTS"  # =1: a journey writes its screenshots to docs/screenshots too
REQUIRE = "TRAINYARD_REQUIRE_BROWSER"  # =1 (scripts/test.sh): a missing Chromium fails the browser tests, not skips
ARTIFACTS = "TRAINYARD_TEST_ARTIFACTS"  # a folder: every screenshot is kept under ARTIFACTS/screenshots as well


@contextlib.contextmanager
def open_page(origin: str | None = None) -> Iterator:
    """A page of a fresh browser context (VIEWPORT); origin (e.g. "http://127.0.0.1:8501") may read and write the
    clipboard, for a copy button."""
    if not CHROMIUM.exists():
        why = f"{CHROMIUM} is missing: the browser tests drive the system Chromium (apt-get install chromium)"
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(why)
        pytest.skip(why)
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True)
        try:
            context = browser.new_context(viewport=VIEWPORT)
            if origin:
                context.grant_permissions(["clipboard-read", "clipboard-write"], origin=origin)
            page = context.new_page()
            page.set_default_timeout(TIMEOUT_MS)
            yield page
        finally:
            browser.close()


def sign_in(page, key: str) -> None:
    """Type the key into the sidebar's API key field, as a user does."""
    from playwright.sync_api import expect

    field = page.get_by_label("API key")
    field.fill(key)
    field.press("Enter")
    # .first: while the app reruns, Streamlit keeps the previous run's element until the new one replaces it.
    expect(page.get_by_text("Signed in as").first).to_be_visible()


def choose_file(page, path: Path) -> None:
    """Pick a file in the real file input and wait until it has reached the server.

    The chip shows a spinner while the file is uploading; a click before it ends would rerun the app with the
    uploader's previous file.
    """
    from playwright.sync_api import expect

    page.get_by_test_id("stFileUploaderDropzoneInput").set_input_files(path)
    expect(page.get_by_test_id("stFileChipName").get_by_text(path.name, exact=True)).to_be_visible()
    expect(page.get_by_test_id("stFileChipIconSpinner")).to_have_count(0)
    expect(page.get_by_role("button", name="Validate and upload")).to_be_enabled()


def settle(page, quiet_s: float = 0.7) -> None:
    """Wait until the app has been idle for quiet_s: not running, and no stale element (Streamlit dims the previous
    run's elements until the new run replaces them). Streamlit shows its running indicator only after a run has
    lasted a moment, so one idle look could fall between a click and that indicator."""
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    idle_since = None
    while True:
        now = time.monotonic()
        if page.evaluate(BUSY):
            idle_since = None
        elif idle_since is None:
            idle_since = now
        elif now - idle_since >= quiet_s:
            return
        if now > deadline:
            raise TimeoutError(f"the app was still running after {TIMEOUT_MS / 1000:.0f} s")
        page.wait_for_timeout(100)


def small_png(png: bytes) -> bytes:
    """A screenshot as a 256-color PNG: a third of the size, and a dashboard has few colors."""
    from PIL import Image

    image = Image.open(io.BytesIO(png)).convert("RGB")
    out = io.BytesIO()
    image.quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(out, "PNG",
                                                                                              optimize=True)
    return out.getvalue()


def screenshot(page, folder: Path, name: str, top=None) -> Path:
    """The viewport (not the full page) as folder/name.png once the app has settled, with the locator `top` (if
    given) scrolled to the top of the view; also written to docs/screenshots when TRAINYARD_UPDATE_SCREENSHOTS=1, and
    kept under $TRAINYARD_TEST_ARTIFACTS/screenshots when that is set."""
    if top is not None:
        top.evaluate("e => e.scrollIntoView({block: 'start'})")
    page.mouse.move(VIEWPORT["width"] - 10, VIEWPORT["height"] // 2)  # the margin: no element shows its hover toolbar
    settle(page)
    png = small_png(page.screenshot())
    path = folder / f"{name}.png"
    path.write_bytes(png)
    if os.environ.get(UPDATE_SCREENSHOTS) == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        (SCREENSHOTS / path.name).write_bytes(png)
    if os.environ.get(ARTIFACTS):
        kept = Path(os.environ[ARTIFACTS]) / "screenshots"
        kept.mkdir(parents=True, exist_ok=True)
        (kept / path.name).write_bytes(png)
    return path
