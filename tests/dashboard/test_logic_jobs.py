"""The Jobs, Checkpoints and Evaluations pages' logic (dashboard/logic_jobs.py), without Streamlit or servers."""
from __future__ import annotations

import json
import math
from datetime import datetime, timezone

import pandas as pd
import pytest
from google.protobuf.timestamp_pb2 import Timestamp

from dashboard import logic_jobs
from trainyard.client import job_spec
from trainyard.v1 import scheduler_pb2 as pb

T0 = 1_800_000_000  # seconds since the epoch of the first synthetic metric point


def point(step: int, t: float | None = None, **values) -> pb.MetricPoint:
    p = pb.MetricPoint(step=step, values={k.replace("__", "/"): v for k, v in values.items()})
    if t is not None:
        p.time.CopyFrom(Timestamp(seconds=int(T0 + t), nanos=int(round((t % 1) * 1e9))))
    return p


def job(method: str = "sft", status: int = pb.JOB_STATUS_RUNNING, step: int = 0, total: int = 0,
        **settings) -> pb.Job:
    spec = job_spec(method, "tiny-qwen3", "ds_1", "run", **settings)
    return pb.Job(id=f"job_{method}", spec=spec, status=status, step=step, total_steps=total)


def test_ema_matches_pandas_ewm():
    """Reference: pandas' ewm(alpha=1 - weight, adjust=False), the same recurrence; tolerance 1e-12."""
    values = [3.0, 2.5, 2.7, 1.9, 2.2, 1.5, 1.6, 1.1]
    for weight in (0.0, 0.3, 0.6, 0.95):
        expected = pd.Series(values).ewm(alpha=1 - weight, adjust=False).mean().tolist()
        assert logic_jobs.ema(values, weight) == pytest.approx(expected, abs=1e-12)
    assert logic_jobs.ema(values, 0.0) == values
    with pytest.raises(ValueError, match="smoothing must be >= 0 and < 1, got 1"):
        logic_jobs.ema(values, 1.0)
    smoothed = logic_jobs.ema([1.0, math.nan, 3.0], 0.5)  # a non-finite value passes through, outside the average
    assert smoothed[0] == 1.0 and math.isnan(smoothed[1]) and smoothed[2] == 2.0


def test_smooth_keeps_each_run_and_metric_apart():
    frame = pd.DataFrame({"run": ["a", "a", "a", "b", "b", "a"], "step": [1, 2, 3, 1, 2, 1],
                          "metric": ["train/loss"] * 5 + ["eval/loss"], "value": [4.0, 2.0, 2.0, 10.0, 0.0, 9.0]})
    out = logic_jobs.smooth(frame, 0.5)
    got = {(r.run, r.metric, r.step): r.smoothed for r in out.itertuples()}
    assert got == {("a", "train/loss", 1): 4.0, ("a", "train/loss", 2): 3.0, ("a", "train/loss", 3): 2.5,
                   ("b", "train/loss", 1): 10.0, ("b", "train/loss", 2): 5.0, ("a", "eval/loss", 1): 9.0}
    assert list(out["value"]) == list(out.sort_values(["run", "metric", "step"])["value"])  # the raw values stay


def test_eta_from_the_median_step_time():
    # 2 s per step, with a 100 s gap (a resumed attempt) between steps 5 and 6 that the median ignores
    points = [point(s, 2.0 * s + (100 if s > 5 else 0), train__loss=1.0) for s in range(1, 11)]
    points.insert(5, point(5, 10.5, eval__loss=1.0))  # a second point at a step keeps the step's latest time
    assert logic_jobs.seconds_per_step(points) == pytest.approx(2.0)
    running = job(status=pb.JOB_STATUS_RUNNING, step=10, total=40)
    assert logic_jobs.eta_s(running, points) == pytest.approx(60.0)
    assert logic_jobs.eta_s(job(status=pb.JOB_STATUS_SUCCEEDED, step=10, total=40), points) is None
    assert logic_jobs.eta_s(job(step=1, total=40), points[:1]) is None  # one timed step: no rate yet
    assert logic_jobs.eta_s(job(step=3, total=0), points) is None  # total steps not known yet
    assert logic_jobs.seconds_per_step([point(s, 3.0 * s) for s in (1, 3, 7)]) == pytest.approx(3.0)
    assert [logic_jobs.duration_text(s) for s in (None, 7.4, 65, 3725)] == ["", "7s", "1m 05s", "1h 02m"]


def test_overlay_frame_and_charts_of_sft_and_rft_runs():
    sft = [point(s, 0.5 * s, train__loss=2.0 / s, train__lr=1e-3, train__grad_norm=0.5, train__tokens=100.0)
           for s in range(1, 5)]
    sft[-1].values["eval/loss"] = 1.2
    rft = [point(s, 1.0 * s, **{"train__loss": 0.1, "reward__mean": 0.2 * s, "train__tokens_per_s": 50.0})
           for s in range(1, 4)]
    frame = logic_jobs.overlay_frame({"sft run": sft, "rft run": rft})
    assert set(frame["run"]) == {"sft run", "rft run"}
    rates = frame[frame["metric"] == "tokens/s"]
    assert list(rates["step"]) == [2, 3, 4] and list(rates["value"]) == pytest.approx([200.0] * 3)  # 100 / 0.5 s
    charts = dict(logic_jobs.charts_for(logic_jobs.smooth(frame, 0.0)))
    assert list(charts) == ["Loss", "Reward", "Learning rate", "Gradient norm", "Throughput"]
    assert set(charts["Loss"]["metric"]) == {"train/loss", "eval/loss"} and set(charts["Loss"]["run"]) == {
        "sft run", "rft run"}
    assert set(charts["Reward"]["run"]) == {"rft run"}
    assert set(charts["Throughput"]["metric"]) == {"tokens/s", "train/tokens_per_s"}
    spec = logic_jobs.metric_chart(charts["Loss"], "Loss", smoothed=True).to_dict()
    assert len(spec["layer"]) == 2  # the raw values behind the smoothed line
    assert logic_jobs.overlay_frame({"empty": []}).empty


def test_a_run_whose_eval_loss_rose_never_reads_as_plain_succeeded():
    train = [point(s, train__loss=2.0 * 0.8 ** s) for s in range(1, 31)]
    for s, v in ((10, 7.2), (20, 7.3), (30, 7.4)):
        train[s - 1].values["eval/loss"] = v
    train[-1].values["train/loss"] = 0.07
    done = job(status=pb.JOB_STATUS_SUCCEEDED, step=30, total=30)
    found = logic_jobs.diagnosis(done, train)
    assert found.problems == ["overfitting"] and found.best_eval_step == 10
    assert logic_jobs.status_text(done, found) == "succeeded with warnings: overfitting"
    frame = logic_jobs.jobs_frame([done], {done.id: train}, datetime.now(timezone.utc))
    assert frame.loc[0, "status"] == "succeeded with warnings: overfitting" and frame.loc[0, "progress"] == 1.0
    assert logic_jobs.diagnosis(job("rft", evaluator="x"), train) is None  # an RL loss is no learning curve
    healthy = [point(s, train__loss=2.0 - 0.05 * s, eval__loss=2.0 - 0.04 * s) for s in range(1, 21)]
    assert logic_jobs.status_text(done, logic_jobs.diagnosis(done, healthy)) == "succeeded"


def test_checkpoints_frame_marks_the_lowest_eval_loss():
    points = [point(s, train__loss=1.0 / s) for s in range(1, 13)]
    for s, v in ((4, 1.5), (8, 1.2), (12, 1.4)):
        points[s - 1].values["eval/loss"] = v
    ckpts = [pb.Checkpoint(id=f"ckpt_{s}", step=s, final=s == 12, kind=pb.CHECKPOINT_KIND_LORA_ADAPTER,
                           files=[pb.CheckpointFile(path="a", size_bytes=2_000_000)]) for s in (12, 4, 8)]
    ckpts[0].metrics["eval/loss"] = 1.4  # the checkpoint's own record comes first
    frame = logic_jobs.checkpoints_frame(ckpts, points)
    assert list(frame["step"]) == [4, 8, 12] and list(frame["best"]) == [False, True, False]
    assert list(frame["eval loss"]) == [1.5, 1.2, 1.4] and list(frame["train loss"]) == pytest.approx([0.25, 0.125,
                                                                                                     1 / 12])
    assert list(frame["final"]) == [False, False, True] and frame.loc[0, "size (MB)"] == 2.0
    assert list(frame["expires (UTC)"]) == ["never"] * 3
    ckpts[1].size_bytes, ckpts[1].expires_at.seconds = 5_000_000, T0  # files and state together, when known
    frame = logic_jobs.checkpoints_frame(ckpts, points)
    assert frame.loc[0, "size (MB)"] == 5.0 and frame.loc[0, "expires (UTC)"] == "2027-01-15 08:00:00"
    assert logic_jobs.best_checkpoint(ckpts, points).id == "ckpt_8"
    assert logic_jobs.best_checkpoint(ckpts[1:], [point(s, train__loss=1.0) for s in (4, 8, 12)]) is None
    assert logic_jobs.nearest_checkpoint(ckpts, 6).step == 4 and logic_jobs.nearest_checkpoint(ckpts, 11).step == 12


def test_evaluation_frames(tmp_path):
    ev = job("eval", status=pb.JOB_STATUS_SUCCEEDED, evaluator="exact@2", checkpoint_id="ckpt_9", samples_per_row=2)
    ev.latest_metrics.update({"eval/pass@1": 0.5, "eval/pass@k": 1.0, "eval/reward_mean": 0.5, "eval/errors": 1.0,
                              "eval/rows": 2.0, "eval/k": 2.0})
    row = logic_jobs.evaluations_frame([ev]).iloc[0]
    assert (row["evaluator"], row["checkpoint"], row["pass@1"], row["rows"]) == ("exact@2", "ckpt_9", 0.5, 2.0)
    base = job("eval", status=pb.JOB_STATUS_QUEUED, evaluator="exact")
    assert logic_jobs.evaluations_frame([base]).iloc[0]["checkpoint"] == "base model tiny-qwen3"
    results = tmp_path / "results.jsonl"
    results.write_text("\n".join(json.dumps(r) for r in (
        {"row": 0, "completions": ["4", "5"], "rewards": [1.0, 0.0], "errors": ["", ""], "passed": 1},
        {"row": 1, "completions": ["x", "y"], "rewards": [None, 1.0], "errors": ["TimeoutError: slow", ""],
         "passed": 1})) + "\n")
    frame = logic_jobs.results_frame(results)
    assert list(frame["passed"]) == ["1 / 2", "1 / 2"] and list(frame["reward mean"]) == [0.5, 1.0]
    assert list(frame["first completion"]) == ["4", "x"] and list(frame["errors"]) == [0, 1]
    assert frame.loc[1, "first error"] == "TimeoutError: slow"


def test_clone_spec_carries_the_settings_and_resources():
    original = job(learning_rate=2e-3, lora_rank=8, lr_scheduler="linear", max_steps=30)
    original.spec.priority = 3
    original.spec.resources.trainer_devices = 1
    spec = logic_jobs.clone_spec(original)
    assert (spec.method, spec.base_model, spec.dataset_id) == ("sft", "tiny-qwen3", "ds_1")
    assert spec.settings["learning_rate"] == pytest.approx(2e-3)
    assert (spec.settings["lora_rank"], spec.settings["lr_scheduler"], spec.settings["max_steps"]) == (8, "linear", 30)
    args, kwargs = spec.create_args("again", max_steps=10)
    assert args == ("sft", "tiny-qwen3", "ds_1", "again")
    assert kwargs["max_steps"] == 10 and kwargs["lora_rank"] == 8 and kwargs["priority"] == 3
    assert kwargs["trainer_devices"] == 1 and "rollout_devices" not in kwargs
    rebuilt = job_spec(*args, **kwargs)  # what create_job sends: the same settings, the edit applied
    assert (rebuilt.sft.lora.rank, rebuilt.sft.max_steps, rebuilt.sft.lr_scheduler) == (8, 10, pb.LR_SCHEDULER_LINEAR)
    assert logic_jobs.unique_name("run-clone", {"run-clone", "run-clone-2"}) == "run-clone-3"
    original.spec.display_name = "my run!"
    assert logic_jobs.deployment_name(original, {"my-run"}) == "my-run-2"
