"""The dashboard in a real headless Chromium (Playwright, sync API), served by the stack's `dashboard` service.

One walk through the no-code path: sign in from the sidebar, upload a good and a bad JSONL file through the real file
input, launch a short SFT job on the shared "tiny-qwen3" and watch its status, loss chart and log appear live.
"""
from __future__ import annotations

import json
import time

import pytest

from tests.conftest import create_account
from tests.dashboard.browser import TIMEOUT_MS, choose_file, open_page, sign_in
from tests.integration.data import chat_rows, jsonl

pytestmark = [pytest.mark.browser, pytest.mark.integration]


@pytest.fixture()
def page():
    with open_page() as pg:
        yield pg


def test_sign_in_upload_train_and_watch(stack, page, tmp_path):
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    key = create_account(stack.env_for("scheduler"), "dashboard-browser")
    good, bad = tmp_path / "addition.jsonl", tmp_path / "broken.jsonl"
    good.write_bytes(jsonl(chat_rows(12)))
    bad.write_bytes(jsonl(chat_rows(2)) + json.dumps({"messages": 3}).encode() + b"\n")

    page.goto(f"http://{stack.url('dashboard')}/")
    expect(page.get_by_text("Enter your API key")).to_be_visible()
    sign_in(page, key)
    expect(page.get_by_role("heading", name="Datasets", exact=True)).to_be_visible()

    # A valid file: stored, with its id, format, row count and first rows.
    upload = page.get_by_role("button", name="Validate and upload")
    choose_file(page, good)
    upload.click()
    expect(page.get_by_text("as dataset").first).to_be_visible()
    expect(page.get_by_text("sft_chat", exact=True).first).to_be_visible()  # the summary, and the datasets table once it renders
    expect(page.get_by_test_id("stTable").first.get_by_text("user: What is 1 plus 1?")).to_be_visible()

    # An invalid file: nothing stored, the bad row named.
    choose_file(page, bad)
    upload.click()
    expect(page.get_by_text("was not stored").first).to_be_visible()
    problems = page.get_by_test_id("stTable").first
    expect(problems.get_by_text("expected a list of messages, got number")).to_be_visible()
    expect(problems.get_by_role("cell", name="3", exact=True)).to_be_visible()
    page.screenshot(path=tmp_path / "datasets.png", full_page=True)

    # Train: a short SFT job on the shared tiny model.
    page.get_by_test_id("stSidebarNav").get_by_role("link", name="Train").click()
    expect(page.get_by_role("heading", name="Train", exact=True)).to_be_visible()
    expect(page.get_by_text("Fine-tune tiny-qwen3")).to_be_visible()
    for label, value in (("Max steps", "4"), ("Batch size", "2"), ("Checkpoint every", "2")):
        field = page.get_by_role("spinbutton", name=label)
        field.fill(value)
        field.press("Enter")
    expect(page.get_by_text("Length: 4 steps of 2 sequences each")).to_be_visible()
    page.get_by_role("button", name="Launch training").click()
    expect(page.get_by_text("Launched job")).to_be_visible()
    page.get_by_role("button", name="Watch it on the Jobs page").click()

    # Jobs: the panel refreshes itself until the job has succeeded; then the chart, the log and Deploy show.
    expect(page.get_by_role("heading", name="Jobs", exact=True)).to_be_visible()
    expect(page.get_by_test_id("stProgress")).to_be_visible()
    expect(page.get_by_text("succeeded", exact=True)).to_be_visible(timeout=240_000)
    expect(page.get_by_test_id("stVegaLiteChart").first).to_be_visible()  # one chart per kind of metric
    expect(page.get_by_text("succeeded after 4 steps")).to_be_visible()
    expect(page.get_by_test_id("stMain").get_by_role("button", name="Deploy")).to_be_visible()
    page.screenshot(path=tmp_path / "job.png", full_page=True)
    assert (tmp_path / "job.png").stat().st_size > 0


def test_reload_stays_signed_in_until_sign_out(stack, page, tmp_path):
    """A typed key starts a server-side session (dashboard/sessions.py): a reload or a new tab of the same browser
    stays signed in, the key is no longer in the page, and Sign out ends it. The shipped .streamlit/config.toml hides
    Streamlit's own Deploy button and developer menu."""
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    key = create_account(stack.env_for("scheduler"), "dashboard-reload")
    page.goto(f"http://{stack.url('dashboard')}/")
    sign_in(page, key)
    expect(page.get_by_role("button", name="Sign out")).to_be_visible()
    expect(page.get_by_label("API key")).to_have_count(0)  # the key is not kept in the page
    expect(page.get_by_test_id("stAppDeployButton")).to_have_count(0)
    expect(page.get_by_test_id("stMainMenu")).to_have_count(0)
    deadline = time.monotonic() + 30
    while not any(c["name"] == "trainyard_session" for c in page.context.cookies()):
        assert time.monotonic() < deadline, "the session cookie was not set"
        page.wait_for_timeout(200)
    cookie = next(c for c in page.context.cookies() if c["name"] == "trainyard_session")
    assert cookie["sameSite"] == "Strict" and key not in cookie["value"]

    page.reload()
    expect(page.get_by_text("Signed in as dashboard-reload")).to_be_visible()
    other = page.context.new_page()
    other.goto(f"http://{stack.url('dashboard')}/jobs")
    expect(other.get_by_text("Signed in as dashboard-reload")).to_be_visible()
    other.close()

    page.get_by_role("button", name="Sign out").click()
    expect(page.get_by_label("API key")).to_be_visible()
    page.reload()
    expect(page.get_by_text("Enter your API key")).to_be_visible()  # the session is gone on the server too
