"""What the Jobs, Checkpoints and Evaluations pages compute, without Streamlit: the jobs table, metric frames of one
or several runs (smoothed, overlaid), the ETA from the measured step rate, the run's diagnosis (overfitting,
divergence, no learning: services/planner/diagnose.py), checkpoints with their metrics and the best one, evaluation
results, and a job's settings for a clone.
"""
from __future__ import annotations

import json
import math
import re
import statistics
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import altair as alt
import pandas as pd

from dashboard.logic import when
from services.planner.diagnose import Diagnosis, diagnose
from trainyard.client import TERMINAL, status_name
from trainyard.methods import BY_PROTO, Method
from trainyard.methods.proto import read
from trainyard.v1 import scheduler_pb2 as pb

# The charts of the Jobs page: a chart is drawn when the selected runs have any of its metrics. SFT writes
# train/loss, eval/loss, train/lr, train/grad_norm and train/tokens; DPO adds the reward margins and accuracies and
# counts train/pairs; RFT writes reward/mean and train/tokens_per_s (services/trainer/sft.py, dpo.py, rl/loop.py).
CHARTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("Loss", ("train/loss", "eval/loss")),
    ("Reward", ("reward/mean", "train/reward_margin", "eval/reward_margin", "train/reward_accuracy",
                "eval/reward_accuracy")),
    ("Learning rate", ("train/lr",)),
    ("Gradient norm", ("train/grad_norm",)),
    ("Throughput", ("train/tokens_per_s", "tokens/s", "pairs/s")),
)
# Throughput derived from a per-step count and the time between metric points (RFT reports train/tokens_per_s).
RATES = {"train/tokens": "tokens/s", "train/pairs": "pairs/s"}
DIAGNOSED = ("sft", "dpo")  # methods whose train/eval losses diagnose() reads (an RL loss is no learning curve)
ETA_WINDOW = 20  # step intervals the ETA's step rate is measured over
RESULTS_FILE = "results.jsonl"  # an evaluation job's per-row results (docs/evaluation.md)
EVAL_METRICS = ("eval/pass@1", "eval/pass@k", "eval/reward_mean", "eval/errors", "eval/rows", "eval/k")


def method_of(job: pb.Job) -> Method:
    return BY_PROTO[job.spec.method]


def job_name(job: pb.Job) -> str:
    return job.spec.display_name or job.id


def duration_text(seconds: float | None) -> str:
    """'1h 02m', '3m 05s', '12s'; '' for unknown."""
    if seconds is None or not math.isfinite(seconds) or seconds < 0:
        return ""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m {s % 60:02d}s"
    return f"{s}s"


def duration_s(job: pb.Job, now: datetime) -> float | None:
    """Seconds the job has run: started to finished, or to now while it runs."""
    if not job.started_at.seconds:
        return None
    end = job.finished_at.ToDatetime(timezone.utc) if job.finished_at.seconds else now
    return (end - job.started_at.ToDatetime(timezone.utc)).total_seconds()


# -- ETA ----------------------------------------------------------------------------------------------------------
def seconds_per_step(points: list[pb.MetricPoint], window: int = ETA_WINDOW) -> float | None:
    """The measured time per optimizer step: the median over the last `window` step intervals of the metric points'
    timestamps (the median, so the gap of a resumed attempt or an eval pass does not dominate). None with fewer than
    two timed steps."""
    last: dict[int, float] = {}
    for p in points:
        if p.time.seconds or p.time.nanos:
            last[p.step] = p.time.ToDatetime(timezone.utc).timestamp()
    steps = sorted(last)[-(window + 1):]
    per_step = [(last[b] - last[a]) / (b - a) for a, b in zip(steps, steps[1:])]
    return statistics.median(per_step) if per_step else None


def eta_s(job: pb.Job, points: list[pb.MetricPoint]) -> float | None:
    """Seconds left for a running job at its measured step rate; None when it cannot be told (not running, the
    total unknown, fewer than two timed steps)."""
    if job.status != pb.JOB_STATUS_RUNNING or not job.total_steps:
        return None
    rate = seconds_per_step(points)
    if rate is None:
        return None
    return max(job.total_steps - job.step, 0) * rate


# -- diagnosis ------------------------------------------------------------------------------------------------------
def diagnosis(job: pb.Job, points: list[pb.MetricPoint]) -> Diagnosis | None:
    """diagnose() of a training job's losses; None for the methods it does not read (RFT, evaluations, loops)."""
    if method_of(job).name not in DIAGNOSED:
        return None
    return diagnose(points)


def status_text(job: pb.Job, found: Diagnosis | None) -> str:
    """The job's status in words, with the diagnosis' problems: a job that overfit never reads as plain
    'succeeded'."""
    status = status_name(job.status)
    if job.cancel_requested and job.status not in TERMINAL:
        status += " (cancelling)"
    if found is not None and found.problems:
        status += " with warnings: " + ", ".join(found.problems)
    return status


# -- the jobs table -------------------------------------------------------------------------------------------------
def jobs_frame(jobs: list[pb.Job], points: dict[str, list[pb.MetricPoint]], now: datetime) -> pd.DataFrame:
    """One line per job; points: the metrics of the jobs that have been read (ETA and diagnosis need them)."""
    rows = []
    for j in jobs:
        pts = points.get(j.id, [])
        found = diagnosis(j, pts) if j.id in points else None
        rows.append({
            "name": job_name(j), "id": j.id, "method": method_of(j).name, "base model": j.spec.base_model,
            "status": status_text(j, found),
            "progress": min(j.step / j.total_steps, 1.0) if j.total_steps else 0.0,
            "step": f"{j.step} / {j.total_steps}" if j.total_steps else str(j.step),
            "created (UTC)": when(j.created_at), "duration": duration_text(duration_s(j, now)),
            "ETA": duration_text(eta_s(j, pts)),
        })
    return pd.DataFrame(rows, columns=["name", "id", "method", "base model", "status", "progress", "step",
                                       "created (UTC)", "duration", "ETA"])


# -- metric frames: several runs, smoothed ---------------------------------------------------------------------------
def run_frame(run: str, points: list[pb.MetricPoint]) -> pd.DataFrame:
    """Long form (run, step, metric, value) of every metric of one run, with the derived throughput (a per-step
    count over the time since the previous point)."""
    rows, prev = [], None
    for p in points:
        t = p.time.ToDatetime(timezone.utc).timestamp() if (p.time.seconds or p.time.nanos) else None
        for k, v in p.values.items():
            rows.append((run, p.step, k, v))
        for count, rate in RATES.items():
            if count in p.values and t is not None and prev is not None and t > prev[1] and p.step > prev[0]:
                rows.append((run, p.step, rate, p.values[count] * (p.step - prev[0]) / (t - prev[1])))
        if t is not None and "train/loss" in p.values:
            prev = (p.step, t)
    return pd.DataFrame(rows, columns=["run", "step", "metric", "value"])


def overlay_frame(runs: dict[str, list[pb.MetricPoint]]) -> pd.DataFrame:
    """The runs' frames on top of each other (run: the label to tell them apart)."""
    frames = [run_frame(label, points) for label, points in runs.items()]
    frames = [f for f in frames if not f.empty]
    if not frames:
        return pd.DataFrame(columns=["run", "step", "metric", "value"])
    return pd.concat(frames, ignore_index=True)


def ema(values: list[float], weight: float) -> list[float]:
    """Exponential moving average: s_0 = x_0, s_t = weight * s_(t-1) + (1 - weight) * x_t (weight 0: the values
    as they are). Non-finite values pass through and do not enter the average."""
    if not 0 <= weight < 1:
        raise ValueError(f"smoothing must be >= 0 and < 1, got {weight}")
    out, s = [], None
    for x in values:
        if not math.isfinite(x):
            out.append(x)
            continue
        s = x if s is None else weight * s + (1 - weight) * x
        out.append(s)
    return out


def smooth(frame: pd.DataFrame, weight: float) -> pd.DataFrame:
    """The frame with a `smoothed` column: ema() of each (run, metric) series in step order."""
    out = frame.sort_values(["run", "metric", "step"], kind="stable").reset_index(drop=True)
    out["smoothed"] = out["value"].astype(float)
    for _, idx in out.groupby(["run", "metric"], sort=False).groups.items():
        out.loc[idx, "smoothed"] = ema(out.loc[idx, "value"].astype(float).tolist(), weight)
    return out


def charts_for(frame: pd.DataFrame) -> list[tuple[str, pd.DataFrame]]:
    """(title, the frame's rows of its metrics) for each chart the frame has data for, in CHARTS order."""
    out = []
    for title, metrics in CHARTS:
        part = frame[frame["metric"].isin(metrics)]
        if not part.empty:
            out.append((title, part))
    return out


def metric_chart(frame: pd.DataFrame, title: str, smoothed: bool) -> alt.LayerChart:
    """Smoothed lines (the raw values faint behind them when smoothing is on); color tells the runs apart, the dash
    the metrics."""
    metrics = [m for _, ms in CHARTS for m in ms if m in set(frame["metric"])]
    base = alt.Chart(frame).encode(
        x=alt.X("step:Q", title="step", axis=alt.Axis(format="d", tickMinStep=1)),
        color=alt.Color("run:N", title="run"),
        strokeDash=alt.StrokeDash("metric:N", title="metric", sort=metrics),
        tooltip=["run", "metric", "step", alt.Tooltip("value:Q", format=".4g"),
                 alt.Tooltip("smoothed:Q", format=".4g")])
    y = alt.Y("smoothed:Q", title=title, scale=alt.Scale(zero=False))
    line = base.mark_line(point=alt.OverlayMarkDef(size=20, filled=True)).encode(y=y)
    if not smoothed:
        return alt.layer(line)
    raw = base.mark_line(opacity=0.25).encode(y=alt.Y("value:Q", title=title, scale=alt.Scale(zero=False)))
    return alt.layer(raw, line)


# -- checkpoints ----------------------------------------------------------------------------------------------------
def value_at(points: list[pb.MetricPoint], key: str, step: int) -> float | None:
    for p in points:
        if p.step == step and key in p.values:
            return p.values[key]
    return None


def best_checkpoint(checkpoints: list[pb.Checkpoint], points: list[pb.MetricPoint]) -> pb.Checkpoint | None:
    """The checkpoint with the lowest held-out loss at its step; None when no checkpoint has one."""
    scored = [(loss, c.step, c) for c in checkpoints
              if (loss := checkpoint_metric(c, points, "eval/loss")) is not None and math.isfinite(loss)]
    return min(scored, key=lambda t: (t[0], t[1]))[2] if scored else None


def checkpoint_metric(c: pb.Checkpoint, points: list[pb.MetricPoint], key: str) -> float | None:
    """A metric at the checkpoint's step: the checkpoint's own record, else the job's metric point at that step."""
    return c.metrics[key] if key in c.metrics else value_at(points, key, c.step)


def checkpoints_frame(checkpoints: list[pb.Checkpoint], points: list[pb.MetricPoint]) -> pd.DataFrame:
    best = best_checkpoint(checkpoints, points)
    rows = [{"step": c.step, "id": c.id, "best": best is not None and c.id == best.id, "final": c.final,
             "train loss": checkpoint_metric(c, points, "train/loss"),
             "eval loss": checkpoint_metric(c, points, "eval/loss"),
             "kind": pb.CheckpointKind.Name(c.kind).removeprefix("CHECKPOINT_KIND_").lower(),
             "size (MB)": round((c.size_bytes or sum(f.size_bytes for f in c.files)) / 1e6, 2),
             "created (UTC)": when(c.created_at), "expires (UTC)": when(c.expires_at) or "never"}
            for c in sorted(checkpoints, key=lambda c: c.step)]
    return pd.DataFrame(rows, columns=["step", "id", "best", "final", "train loss", "eval loss", "kind", "size (MB)",
                                       "created (UTC)", "expires (UTC)"])


def nearest_checkpoint(checkpoints: list[pb.Checkpoint], step: int) -> pb.Checkpoint | None:
    """The checkpoint whose step is closest to step (the earlier one on a tie)."""
    return min(checkpoints, key=lambda c: (abs(c.step - step), c.step)) if checkpoints else None


# -- evaluations ----------------------------------------------------------------------------------------------------
def eval_settings(job: pb.Job) -> dict:
    return read(BY_PROTO[pb.JOB_METHOD_EVAL].settings, job.spec.eval)


def evaluations_frame(jobs: list[pb.Job]) -> pd.DataFrame:
    """One line per evaluation job: what it scored, with what, and its results."""
    rows = []
    for j in jobs:
        cfg, m = eval_settings(j), j.latest_metrics
        rows.append({"name": job_name(j), "id": j.id, "status": status_name(j.status),
                     "evaluator": cfg.get("evaluator", ""),
                     "checkpoint": cfg.get("checkpoint_id") or f"base model {j.spec.base_model}",
                     "dataset": j.spec.dataset_id,
                     "pass@1": m.get("eval/pass@1"), "pass@k": m.get("eval/pass@k"),
                     "reward mean": m.get("eval/reward_mean"), "errors": m.get("eval/errors"),
                     "rows": m.get("eval/rows"), "k": m.get("eval/k"), "created (UTC)": when(j.created_at)})
    return pd.DataFrame(rows, columns=["name", "id", "status", "evaluator", "checkpoint", "dataset", "pass@1",
                                       "pass@k", "reward mean", "errors", "rows", "k", "created (UTC)"])


def results_frame(path: Path) -> pd.DataFrame:
    """An evaluation's results.jsonl as one line per row: passes of k, mean reward, the first completion and the
    first error (the full lists stay in the file)."""
    rows = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        r = json.loads(line)
        rewards = [x for x in r["rewards"] if x is not None]
        errors = [e for e in r.get("errors", []) if e]
        rows.append({"row": r["row"], "passed": f"{r['passed']} / {len(r['rewards'])}",
                     "reward mean": sum(rewards) / len(rewards) if rewards else None,
                     "first completion": r["completions"][0] if r["completions"] else "",
                     "errors": len(errors), "first error": errors[0] if errors else ""})
    return pd.DataFrame(rows, columns=["row", "passed", "reward mean", "first completion", "errors", "first error"])


# -- clone ----------------------------------------------------------------------------------------------------------
@dataclass
class CloneSpec:
    """What create_job needs to run a job again: its method, model, dataset, settings and resources."""

    method: str
    base_model: str
    dataset_id: str
    settings: dict
    resources: dict

    def create_args(self, display_name: str, **edits) -> tuple[tuple, dict]:
        """(args, kwargs) of Client.create_job, the edited settings over the job's own."""
        return (self.method, self.base_model, self.dataset_id, display_name), {**self.settings, **edits,
                                                                               **self.resources}


def clone_spec(job: pb.Job) -> CloneSpec:
    """The job's settings as stored (the server's resolved values) and its resources, for a new job."""
    method = method_of(job)
    r = job.spec.resources
    resources = {"priority": job.spec.priority}
    for name in ("trainer_devices", "rollout_devices"):
        if r.HasField(name):
            resources[name] = getattr(r, name)
    return CloneSpec(method.name, job.spec.base_model, job.spec.dataset_id,
                     read(method.settings, getattr(job.spec, method.config)), resources)


def unique_name(base: str, taken: set[str]) -> str:
    """base, or base-2, base-3, ... whichever is not taken."""
    name, n = base, 1
    while name in taken:
        n += 1
        name = f"{base}-{n}"
    return name


def deployment_name(job: pb.Job, taken: set[str], suffix: str = "") -> str:
    """A free deployment name from the job's name (letters, digits, '-', '_' and '.' only)."""
    base = re.sub(r"[^A-Za-z0-9._-]+", "-", job.spec.display_name).strip("-._")[:100] or job.id
    return unique_name(base + suffix, taken)
