"""The no-code lifecycle in a real headless Chromium, on the stack's `dashboard` service, as a new user walks it:
sign in -> upload the sample data -> describe the task -> the Training Agent's plan (method, base model, each setting
with why, the estimate) -> approve -> watch the job live on the Jobs page until it succeeds -> deploy it on the
Deployments page -> compare base and tuned in the Playground -> copy the endpoint's curl snippet and run it with the
account's key, and the Python one with the OpenAI client.

Each step leaves a screenshot (the 1280x800 viewport) in the test's tmp dir; TRAINYARD_UPDATE_SCREENSHOTS=1 writes
them to docs/screenshots/ as well (the README shows those).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import create_account
from tests.dashboard.browser import TIMEOUT_MS, choose_file, open_page, screenshot, settle, sign_in

pytestmark = [pytest.mark.browser, pytest.mark.integration]

DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "sft_demo.jsonl"
TASK = "Answer questions about Trainyard and general knowledge in one short sentence, the way our docs do."
QUESTION = "What does Trainyard do?"
DEPLOYMENT = "acme-answers"
JOB_TIMEOUT_MS = 300_000


def answer_in_data(question: str) -> str:
    """The assistant's answer to question in the sample data (what the tuned model should have learned)."""
    for line in DATA.read_text().splitlines():
        messages = json.loads(line)["messages"]
        if messages[1]["content"] == question:
            return messages[2]["content"]
    raise KeyError(question)


def nav(page, title: str) -> None:
    from playwright.sync_api import expect

    page.get_by_test_id("stSidebarNav").get_by_role("link", name=title).click()
    expect(page.get_by_role("heading", name=title, exact=True)).to_be_visible()


def metric(page, label: str) -> str:
    """The value of the first st.metric labelled label."""
    box = page.get_by_test_id("stMetric").filter(
        has=page.get_by_test_id("stMetricLabel").get_by_text(label, exact=True))
    return box.first.get_by_test_id("stMetricValue").inner_text()


def truncated(locator) -> list[str]:
    """The texts of the elements (or their parts) that do not fit their box: shown cut off with an ellipsis."""
    overflows = "e => [e, ...e.querySelectorAll('*')].some(c => c.scrollWidth > c.clientWidth)"
    return [e.inner_text() for e in locator.all() if e.evaluate(overflows)]


def test_describe_plan_approve_watch_deploy_compare_and_call(stack, tmp_path):
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    key = create_account(stack.env_for("scheduler"), "acme-support")
    origin = f"http://{stack.url('dashboard')}"
    timings: dict[str, float] = {}
    started = time.monotonic()
    with open_page(origin) as page:
        def shot(name: str, top=None) -> None:
            screenshot(page, tmp_path, name, top)
            timings[name] = round(time.monotonic() - started, 1)

        # 1. Sign in.
        page.goto(f"{origin}/")
        expect(page.get_by_text("Enter your API key")).to_be_visible()
        shot("01-sign-in")
        sign_in(page, key)
        expect(page.get_by_role("heading", name="Datasets", exact=True)).to_be_visible()

        # 2. Upload the sample data: validated row by row, stored, previewed.
        choose_file(page, DATA)
        page.get_by_role("button", name="Validate and upload").click()
        # .first here and below: during a rerun Streamlit may still show the previous run's copy of an element.
        stored = page.get_by_text(f"Stored {DATA.name} as dataset").first
        expect(stored).to_be_visible()
        assert (metric(page, "Format"), metric(page, "Rows")) == ("sft_chat", "20")
        assert metric(page, "Dataset id").startswith("ds_")
        assert not truncated(page.get_by_test_id("stMetricValue")), "a figure of the upload is cut off"
        shot("02-dataset", page.get_by_role("heading", name="Upload a dataset"))

        # 3. Describe the task: the agent's plan, each choice with why, and the estimate.
        nav(page, "Describe and plan")
        page.get_by_label("Describe the task").fill(TASK)
        price = page.get_by_role("spinbutton", name="Price per device-hour")
        price.fill("2.5")
        price.press("Enter")
        settle(page)
        # A short calibration job times the plan. (The label takes the click: it lies over the input.)
        page.get_by_test_id("stCheckbox").filter(has_text="Measure the speed").click()
        expect(page.get_by_role("checkbox", name="Measure the speed")).to_be_checked()
        settle(page)
        page.get_by_role("button", name="Plan", exact=True).click()
        expect(page.get_by_role("heading", name="The plan")).to_be_visible(timeout=JOB_TIMEOUT_MS)
        expect(page.get_by_text("Method: Supervised fine-tuning (LoRA)")).to_be_visible()
        expect(page.get_by_text("Base model: tiny-qwen3")).to_be_visible()
        table = page.get_by_test_id("stTable")
        for setting in ("LoRA rank", "Learning rate", "Batch size", "Max steps", "Eval fraction"):
            expect(table.get_by_role("rowheader", name=setting, exact=True)
                   .or_(table.get_by_role("cell", name=setting, exact=True))).to_be_visible()
        expect(table.get_by_text("2 of 20 rows held out")).to_be_visible()  # a "why"
        steps = int(metric(page, "Steps").replace(",", ""))
        assert metric(page, "Rows (train / held out)") == "18 / 2" and steps > 0
        assert metric(page, "Tokens") != "0" and "MiB" in metric(page, "Memory")
        estimate = metric(page, "Time")
        assert re.fullmatch(r"\d+(\.\d)? (s|min|h)", estimate), estimate  # measured by the calibration job
        assert re.fullmatch(r"\d+\.\d\d", metric(page, "Cost")), metric(page, "Cost")
        expect(page.get_by_text(re.compile(r"^Time from [\d,]+ target tokens/s measured on job"))).to_be_visible()
        assert not truncated(page.get_by_test_id("stMetricValue")), "an estimate is cut off"
        shot("03-plan", page.get_by_role("heading", name="The plan"))

        # 4. Approve: the job is created only now.
        page.get_by_role("button", name="Approve and train").click()
        approved = page.get_by_text("Approved: job").first
        expect(approved).to_be_visible()
        job_id = re.search(r"job_[0-9a-f]+", approved.inner_text()).group(0)
        shot("04-approve", page.get_by_role("heading", name="Approve"))

        # 5. Watch it: the panel refreshes itself; the progress and the charts grow while it runs.
        page.get_by_role("button", name="Watch it on the Jobs page").click()
        expect(page.get_by_role("heading", name="Jobs", exact=True)).to_be_visible()
        panel = page.get_by_role("heading", name=re.compile(r"^agent-sft-")).first
        expect(page.get_by_text(re.compile(rf"^step \d+ of {steps} · ETA ")).first).to_be_visible()
        expect(page.get_by_test_id("stVegaLiteChart").first).to_be_visible()
        shot("05-job-running", panel)
        expect(panel).to_contain_text("succeeded", timeout=JOB_TIMEOUT_MS)
        expect(page.get_by_text(f"succeeded after {steps} steps").first).to_be_visible()  # the log
        expect(page.get_by_text(f"step {steps} of {steps}", exact=True).first).to_be_visible()
        shot("06-job-succeeded", panel)

        # 6. Deploy it on the Deployments page.
        nav(page, "Deployments")
        expect(page.get_by_role("combobox", name="Job")).to_have_value(re.compile(rf"· {job_id}$"))
        page.get_by_label("Deployment name").fill(DEPLOYMENT)
        page.get_by_test_id("stMain").get_by_role("button", name="Deploy", exact=True).click()
        expect(page.get_by_text(f"Deployment {DEPLOYMENT} is ready.").first).to_be_visible()
        expect(page.get_by_role("heading", name=DEPLOYMENT)).to_be_visible()  # its card in the list below
        shot("07-deploy", page.get_by_role("heading", name="Deploy", exact=True))

        # 7. Compare: the same question to the base model and the tuned one, greedy.
        nav(page, "Playground")
        temperature = page.get_by_role("slider", name="Temperature")
        temperature.focus()
        page.keyboard.press("Home")
        expect(temperature).to_have_value("0")
        settle(page)
        page.get_by_label("Message").fill(QUESTION)
        page.get_by_role("button", name="Send to all").click()
        chats = page.get_by_test_id("stColumn").filter(has=page.get_by_test_id("stChatMessage"))
        base = chats.filter(has_text="Base model · tiny-qwen3")
        tuned = chats.filter(has_text=f"Fine-tuned · {DEPLOYMENT}")
        for column in (base, tuned):
            expect(column.get_by_text("stopped by")).to_be_visible()
        expected = answer_in_data(QUESTION)
        expect(tuned.get_by_test_id("stCode")).to_have_text(expected)  # the tuned model learned the data
        assert base.get_by_test_id("stCode").inner_text().strip() != expected
        shot("08-playground", page.get_by_text("Base model · tiny-qwen3"))

        # 8. Copy the endpoint's snippets, Python (OpenAI client) and curl: the copy button, read back from the
        # clipboard. Each fits its box (nothing to scroll sideways to).
        nav(page, "Deployments")
        snippets = {}
        for tab, marker in (("Python (OpenAI client)", "from openai import OpenAI"), ("curl", "curl -s")):
            page.get_by_role("tab", name=tab).click()
            code = page.get_by_test_id("stCode").filter(has_text=marker)
            expect(code).to_contain_text(f'"{DEPLOYMENT}"')
            assert not truncated(code), f"the {tab} snippet is wider than its box"
            code.hover()
            code.get_by_label("Copy to clipboard").click()
            snippets[tab] = page.evaluate("navigator.clipboard.readText()")
            assert snippets[tab].strip() == code.inner_text().strip()
            assert key not in snippets[tab] and "TRAINYARD_API_KEY" in snippets[tab]
        shot("09-endpoint-snippet", page.get_by_role("heading", name="Your deployments"))

    # 9. Call the endpoint as the user would: each copied snippet, with the account's key in the environment.
    env = {"PATH": os.environ["PATH"], "TRAINYARD_API_KEY": key}
    out = subprocess.run(["bash", "-c", snippets["curl"]], env=env, capture_output=True, text=True, timeout=120,
                         check=True)
    reply = json.loads(out.stdout)
    assert reply["model"] == DEPLOYMENT and reply["object"] == "chat.completion"
    choice = reply["choices"][0]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert choice["finish_reason"] in ("stop", "length") and reply["usage"]["completion_tokens"] > 0
    out = subprocess.run([sys.executable, "-c", snippets["Python (OpenAI client)"]], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip(), "the OpenAI client printed no answer"
    from trainyard import Client

    with Client(url=stack.url("scheduler"), rollout_url=stack.url("rollout"), api_key=key) as c:
        job = c.get_job(job_id)
    took = job.finished_at.ToDatetime().timestamp() - job.started_at.ToDatetime().timestamp()
    print(f"the plan's time {estimate}, the job ran {took:.1f} s; "
          f"journey timings (s since start, at each screenshot): {timings}")


def test_edit_the_plan_then_sweep_and_name_the_winner(stack, tmp_path):
    """The agent's optional sweep, from the Describe-and-plan page: shorten the plan in "Edit the settings" and
    re-plan (the agent keeps the user's value, "you set it"), start a 2-variant learning-rate sweep, and wait on the
    page until it names the winner with its reason (the variants run on the server; the panel refreshes itself)."""
    from playwright.sync_api import expect

    expect.set_options(timeout=TIMEOUT_MS)
    key = create_account(stack.env_for("scheduler"), "acme-sweeps")
    with open_page() as page:
        page.goto(f"http://{stack.url('dashboard')}/")
        sign_in(page, key)
        choose_file(page, DATA)
        page.get_by_role("button", name="Validate and upload").click()
        expect(page.get_by_text(f"Stored {DATA.name} as dataset").first).to_be_visible()

        nav(page, "Describe and plan")
        page.get_by_label("Describe the task").fill(TASK)
        page.get_by_role("button", name="Plan", exact=True).click()
        expect(page.get_by_role("heading", name="The plan")).to_be_visible()
        page.get_by_text("Edit the settings").click()
        steps = page.get_by_label("Max steps")
        steps.fill("40")
        steps.press("Enter")
        settle(page)
        page.get_by_role("button", name="Re-plan").click()
        table = page.get_by_test_id("stTable")
        expect(table.get_by_text("you set it")).to_be_visible()
        expect(page.get_by_test_id("stMetric").filter(has_text="Steps").first).to_contain_text("40")

        variants = page.get_by_role("spinbutton", name="Variants")
        variants.fill("2")
        variants.press("Enter")
        settle(page)
        page.get_by_role("button", name=re.compile(r"^Run a sweep")).click()
        expect(page.get_by_text("Started a sweep of 2 variants").first).to_be_visible()
        expect(page.get_by_role("heading", name="Sweeps")).to_be_visible()
        winner = page.get_by_text(re.compile(r"^Winner: job job_[0-9a-f]+")).first
        expect(winner).to_be_visible(timeout=JOB_TIMEOUT_MS)
        expect(winner).to_contain_text("has the lowest final held-out loss")
        winner_id = re.search(r"job_[0-9a-f]+", winner.inner_text()).group(0)
        screenshot(page, tmp_path, "10-sweep", page.get_by_role("heading", name="Sweeps"))
        page.get_by_role("button", name="Open the winner on the Jobs page").click()
        expect(page.get_by_role("heading", name="Jobs", exact=True)).to_be_visible()
        expect(page.get_by_role("combobox", name="Job")).to_have_value(re.compile(rf"\({winner_id}\)"))
