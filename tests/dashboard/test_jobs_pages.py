"""The Jobs, Checkpoints and Evaluations pages through Streamlit's AppTest, against the real service stack.

The module signs in with an account of its own, so what a page lists is exactly what the module created.
"""
from __future__ import annotations

import json
import time

import pyarrow as pa
import pytest
from streamlit.testing.v1 import AppTest

from dashboard import logic_jobs
from tests.dashboard.apptest import assert_no_exception, button, open_app, text, widget
from tests.conftest import create_account
from tests.integration.data import chat_rows, jsonl
from trainyard.client import status_name

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("signed_in_env")]
ACCOUNT = "dashboard-jobs"

SHORT_JOB = dict(max_steps=4, batch_size=2, checkpoint_every=2, eval_fraction=0.2, learning_rate=3e-3)
EVALUATOR = b"""
def reward_fn(completion, row):
    return 1.0 if row["answer"] in completion else 0.0
"""


@pytest.fixture(scope="module")
def dataset(sdk):
    ds, _ = sdk.upload_dataset(jsonl(chat_rows(12)), name="addition")
    return ds


def run_job(sdk, dataset, name: str, **settings):
    job = sdk.create_sft_job("tiny-qwen3", dataset.id, name, **(SHORT_JOB | settings))
    job = sdk.wait_job(job.id, timeout_s=300)
    assert status_name(job.status) == "succeeded", job.error
    return job


@pytest.fixture(scope="module")
def finished_job(sdk, dataset):
    return run_job(sdk, dataset, "short-run")


@pytest.fixture(scope="module")
def other_job(sdk, dataset):
    return run_job(sdk, dataset, "other-run", learning_rate=1e-3)


@pytest.fixture(scope="module")
def overfit_job(sdk, dataset):
    """100 steps at a high learning rate on 9 rows: the held-out loss bottoms out near step 30 and then rises 12%
    while the training loss keeps falling (deterministic on the CPU: the seed fixes the data order and the init)."""
    return run_job(sdk, dataset, "overfit-run", max_steps=100, checkpoint_every=20, eval_every=10, eval_fraction=0.25,
                   learning_rate=1e-2)


def charts(at: AppTest) -> dict[str, object]:
    """The page's charts by their title (each chart's data: its first dataset)."""
    out = {}
    for chart in at.get("vega_lite_chart"):
        spec = json.loads(chart.proto.spec)
        title = spec["layer"][-1]["encoding"]["y"]["title"]
        out[title] = pa.ipc.open_stream(chart.proto.datasets[0].data.data).read_pandas()
    return out


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")


# -- jobs -----------------------------------------------------------------------------------------------------------
def test_jobs_page_table_charts_smoothing_and_log(sdk, finished_job):
    at = open_app("pages_jobs.py", job_id=finished_job.id)
    assert at.title[0].value == "Jobs"
    table = at.dataframe[0].value
    row = table[table["id"] == finished_job.id].iloc[0]
    assert (row["name"], row["method"], row["base model"], row["progress"]) == ("short-run", "sft", "tiny-qwen3", 1.0)
    assert row["status"].startswith("succeeded") and row["step"] == "4 / 4" and row["duration"]
    assert ":green-badge[succeeded]" in text(at.markdown) or ":orange-badge[succeeded with warnings]" in \
        text(at.markdown)
    assert at.get("progress")[0].value == 100

    points = sdk.job_metrics(finished_job.id)
    shown = charts(at)
    assert {"Loss", "Learning rate", "Gradient norm", "Throughput"} <= set(shown)
    loss = shown["Loss"]
    expected = {(p.step, k): v for p in points for k, v in p.values.items() if k in ("train/loss", "eval/loss")}
    assert {(int(r.step), r.metric): r.value for r in loss.itertuples()} == pytest.approx(expected)
    assert (loss["smoothed"] == loss["value"]).all()  # smoothing starts off

    widget(at.slider, "Smoothing").set_value(0.5).run()
    assert_no_exception(at)
    loss = charts(at)["Loss"]
    train = loss[loss.metric == "train/loss"].sort_values("step")
    assert list(train["smoothed"]) == pytest.approx(logic_jobs.ema(list(train["value"]), 0.5))
    assert train["smoothed"].iloc[-1] != train["value"].iloc[-1]

    log = text(at.code)
    assert "queued" in log and "succeeded after 4 steps" in log
    assert not [b for b in at.button if b.label in ("Cancel job", "Resume from the last checkpoint")]
    assert "Deploy" in [b.label for b in at.button]


def test_jobs_page_overlays_runs_on_one_chart(finished_job, other_job):
    at = open_app("pages_jobs.py", job_id=finished_job.id)
    widget(at.multiselect, "Compare with").set_value([other_job.id]).run()
    assert_no_exception(at)
    loss = charts(at)["Loss"]
    assert set(loss["run"]) == {f"short-run ({finished_job.id})", f"other-run ({other_job.id})"}
    assert set(loss[loss.run.str.startswith("other-run")]["metric"]) == {"train/loss", "eval/loss"}


def test_jobs_page_cancels_resumes_and_clones(sdk, dataset):
    job = sdk.create_sft_job("tiny-qwen3", dataset.id, "long-run", max_steps=5000, batch_size=1, checkpoint_every=2)
    at = open_app("pages_jobs.py", job_id=job.id)
    wait_for(lambda: sdk.list_checkpoints(job.id), 120, "a checkpoint")
    at.run()
    button(at, "Cancel job").click().run()
    assert_no_exception(at)
    assert sdk.get_job(job.id).cancel_requested
    assert status_name(sdk.wait_job(job.id, timeout_s=120).status) == "cancelled"
    at.run()
    assert ":orange-badge[cancelled]" in text(at.markdown)
    latest = max(sdk.list_checkpoints(job.id), key=lambda c: c.step)

    button(at, "Resume from the last checkpoint").click().run()
    assert_no_exception(at)
    assert f"Job {job.id} is" in text(at.success) and "again" in text(at.success)
    resumed = sdk.get_job(job.id)
    assert status_name(resumed.status) in ("queued", "running") and not resumed.cancel_requested
    logs = [e.message for e in sdk.job_logs(job.id)]
    assert f"resumed: queued again, to continue from the checkpoint at step {latest.step} ({latest.id})" in logs
    sdk.cancel_job(job.id)
    sdk.wait_job(job.id, timeout_s=120)

    at.run()
    widget(at.text_input, "Name of the clone").set_value("long-run-shorter")
    widget(at.number_input, "Max steps").set_value(2)
    button(at, "Create the clone").click().run()
    assert_no_exception(at)
    clone_id = at.session_state["job_id"]
    assert clone_id != job.id and f"Created job {clone_id}, a clone of {job.id}" in text(at.success)
    clone = sdk.get_job(clone_id)
    assert (clone.spec.display_name, clone.spec.sft.max_steps) == ("long-run-shorter", 2)
    original = sdk.get_job(job.id).spec.sft
    assert (clone.spec.sft.batch_size, clone.spec.sft.checkpoint_every) == (original.batch_size, 2)
    assert clone.spec.sft.learning_rate == pytest.approx(original.learning_rate)
    sdk.wait_job(clone_id, timeout_s=300)


def test_jobs_page_clone_shows_field_errors_under_the_input(sdk, finished_job):
    at = open_app("pages_jobs.py", job_id=finished_job.id)
    before = len(sdk.list_jobs())
    widget(at.number_input, "LoRA rank").set_value(0)
    button(at, "Create the clone").click().run()
    assert_no_exception(at)
    # Once under the input, and a line saying the clone was not created (not the same error again).
    assert text(at.error).count("must be between 1 and 1024, got 0") == 1
    assert "The clone was not created" in text(at.error) and not at.table  # no table repeating it
    assert len(sdk.list_jobs()) == before


def test_an_overfit_run_shows_its_warning_not_a_plain_succeeded(sdk, overfit_job):
    found = logic_jobs.diagnosis(overfit_job, sdk.job_metrics(overfit_job.id))
    assert "overfitting" in found.problems
    at = open_app("pages_jobs.py", job_id=overfit_job.id)
    md = text(at.markdown)
    assert ":orange-badge[succeeded with warnings]" in md and ":green-badge[succeeded]" not in md
    assert f"Overfitting: {found.messages[found.problems.index('overfitting')]}" in text(at.warning)
    table = at.dataframe[0].value
    status = table[table["id"] == overfit_job.id].iloc[0]["status"]
    assert status.startswith("succeeded with warnings:") and "overfitting" in status

    at.switch_page("pages_checkpoints.py").run()
    assert_no_exception(at)
    assert "Overfitting: the held-out loss rose" in text(at.warning)
    ckpts = sdk.list_checkpoints(overfit_job.id)
    best = logic_jobs.best_checkpoint(ckpts, sdk.job_metrics(overfit_job.id))
    assert not best.final and f"Best checkpoint: step {best.step} ({best.id})" in text(at.success)
    assert widget(at.selectbox, "Checkpoint").value == best.id  # the deploy form offers the best one first
    button(at, f"Evaluate the checkpoint at step {best.step}").click().run()
    assert_no_exception(at)
    assert at.title[0].value == "Evaluations" and widget(at.selectbox, "Checkpoint").value == best.id


# -- checkpoints ------------------------------------------------------------------------------------------------------
def test_checkpoints_page_marks_the_best_and_deploys_any(sdk, finished_job):
    at = open_app("pages_checkpoints.py", job_id=finished_job.id)
    assert at.title[0].value == "Checkpoints"
    ckpts = sdk.list_checkpoints(finished_job.id)
    points = sdk.job_metrics(finished_job.id)
    best = logic_jobs.best_checkpoint(ckpts, points)
    table = at.dataframe[0].value
    assert list(table["step"]) == [2, 4] and list(table["final"]) == [False, True]
    assert list(table["best"]) == [c.step == best.step for c in sorted(ckpts, key=lambda c: c.step)]
    evals = {p.step: p.values["eval/loss"] for p in points if "eval/loss" in p.values}
    assert list(table["eval loss"]) == pytest.approx([evals[2], evals[4]])
    assert f"Best checkpoint: step {best.step} ({best.id})" in text(at.success)

    first = next(c for c in ckpts if c.step == 2)
    widget(at.selectbox, "Checkpoint").set_value(first.id)
    widget(at.text_input, "Deployment name").set_value("adder-step2")
    button(at, "Deploy").click().run()
    assert_no_exception(at)
    assert "Deployment adder-step2 (the checkpoint at step 2) is ready" in text(at.success)
    dep = sdk.get_deployment("adder-step2")
    assert dep.checkpoint_id == first.id
    assert "adder-step2 · step 2 · ready" in text(at.markdown)

    # Its lifecycle: kept for 2 days, shared, then deleted, which a deployment serving it prevents.
    widget(at.selectbox, "Checkpoint to manage").set_value(first.id).run()
    assert "Expires never · private to your account" in text(at.caption)
    widget(at.number_input, "Keep for (days)").set_value(2)
    button(at, "Set").click().run()
    assert_no_exception(at)
    kept = sdk.get_checkpoint(first.id)
    assert kept.HasField("expires_at") and not kept.public
    assert (kept.expires_at.ToDatetime() - kept.created_at.ToDatetime()).total_seconds() > 86400
    button(at, "Share with every account").click().run()
    assert sdk.get_checkpoint(first.id).public and "shared: every account may read it" in text(at.caption)
    at.checkbox(key=f"sure-{first.id}").check().run()
    button(at, "Delete", key=f"delete-{first.id}").click().run()
    assert_no_exception(at)
    assert "Not possible right now" in text(at.error) and sdk.get_checkpoint(first.id).id == first.id
    sdk.delete_deployment(dep.id)
    at.checkbox(key=f"sure-{first.id}").check().run()
    button(at, "Delete", key=f"delete-{first.id}").click().run()
    assert_no_exception(at)
    assert not at.error, text(at.error)
    assert [c.id for c in sdk.list_checkpoints(finished_job.id)] == [finished_job.output_checkpoint_id]
    assert list(at.dataframe[0].value["step"]) == [4]


# -- evaluations ------------------------------------------------------------------------------------------------------
def test_evaluations_page_launches_one_and_shows_its_results(sdk, finished_job):
    at = open_app("pages_evaluations.py")
    assert at.title[0].value == "Evaluations"
    assert "Upload an evaluator first" in text(at.info)
    sdk.upload_evaluator(EVALUATOR, name="sum-check", filename="evaluator.py")
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]
    rft, _ = sdk.upload_dataset(jsonl(rows), name="sums")
    at.run()
    widget(at.selectbox, "Checkpoint").set_value(finished_job.output_checkpoint_id).run()
    assert "Base model tiny-qwen3 (the checkpoint's)" in text(at.caption)
    widget(at.selectbox, "Dataset").set_value(rft.id)
    widget(at.number_input, "Samples per row (k)").set_value(2)
    widget(at.number_input, "Max tokens").set_value(4)
    widget(at.number_input, "Max rows").set_value(3)
    widget(at.text_input, "Evaluation name").set_value("sums-eval")
    button(at, "Launch evaluation").click().run()
    assert_no_exception(at)
    eval_id = at.session_state["evaluation_id"]
    job = sdk.get_job(eval_id)
    assert (job.spec.eval.evaluator, job.spec.eval.checkpoint_id) == ("sum-check@1", finished_job.output_checkpoint_id)
    assert (job.spec.eval.samples_per_row, job.spec.eval.max_rows, job.spec.eval.max_tokens) == (2, 3, 4)
    done = sdk.wait_job(eval_id, timeout_s=300)
    assert status_name(done.status) == "succeeded", done.error

    at.run()
    assert_no_exception(at)
    table = at.dataframe[0].value
    row = table[table["id"] == eval_id].iloc[0]
    assert (row["evaluator"], row["checkpoint"], row["rows"]) == ("sum-check@1", finished_job.output_checkpoint_id,
                                                                 3.0)
    assert row["pass@1"] == pytest.approx(done.latest_metrics["eval/pass@1"])
    assert {m.label: m.value for m in at.metric}["pass@1"] == f"{done.latest_metrics['eval/pass@1']:.3f}"
    results = at.dataframe[1].value
    assert list(results["row"]) == [0, 1, 2] and all(p.endswith("/ 2") for p in results["passed"])

    at.session_state["job_id"] = eval_id  # on the Jobs page an evaluation is a job like the others
    at.switch_page("pages_jobs.py").run()
    assert_no_exception(at)
    table = at.dataframe[0].value
    assert table[table["id"] == eval_id].iloc[0]["method"] == "eval"
    assert widget(at.text_input, "Evaluator").value == "sum-check@1"  # the clone form carries its settings
    at.switch_page("pages_evaluations.py").run()
    assert widget(at.selectbox, "Evaluation").value == eval_id

    before = len(sdk.list_jobs())
    widget(at.number_input, "Temperature").set_value(5.0)
    button(at, "Launch evaluation").click().run()
    assert_no_exception(at)
    assert text(at.error).count("must be between 0 and 2") == 1 and "evaluation was not launched" in text(at.error)
    assert len(sdk.list_jobs()) == before


def test_pages_of_a_new_account_say_what_to_do_first(stack, monkeypatch):
    monkeypatch.setenv("TRAINYARD_API_KEY", create_account(stack.env_for("scheduler"), "dashboard-jobs-newcomer"))
    expected = {"pages_jobs.py": "No jobs yet", "pages_checkpoints.py": "No training jobs yet",
                "pages_evaluations.py": "No evaluations yet"}
    for page, message in expected.items():
        at = open_app(page)
        assert message in text(at.main.info), page
