"""What the Describe-and-plan page computes, without Streamlit: the Training Agent's plan as tables and sentences, the
user's edits of its settings read back by their declared types, and a sweep's table."""
from __future__ import annotations

from typing import Any

import pandas as pd

from dashboard.logic import md_escape, mib
from services.planner.agent import AgentPlan, SweepResult, duration
from trainyard.client import status_name
from trainyard.methods import METHODS
from trainyard.methods.spec import Field, check_value, format_value
from trainyard.v1 import scheduler_pb2 as pb

HEADLINE_CHOICES = ("method", "base_model", "evaluator")  # shown as sentences, not in the settings table


def fields(plan: AgentPlan) -> dict[str, Field]:
    """The declared settings of the plan's method, by name."""
    return {f.name: f for f in METHODS[plan.method].fields()}


def label(plan: AgentPlan, setting: str) -> str:
    f = fields(plan).get(setting)
    return f.setting.label if f is not None else setting


def editable(plan: AgentPlan) -> list[str]:
    """The plan's settings the user may edit before re-planning (the evaluator is edited as source)."""
    return [k for k in plan.settings if k != "evaluator" and k in fields(plan)]


def choices_frame(plan: AgentPlan) -> pd.DataFrame:
    """One line per proposed setting: its label, value and the rule's reason (or "you set it")."""
    return pd.DataFrame([{"setting": label(plan, c.setting), "value": format_value(c.value), "why": c.why}
                         for c in plan.proposal.choices if c.setting not in HEADLINE_CHOICES],
                        columns=["setting", "value", "why"])


def headline(plan: AgentPlan) -> list[str]:
    """The method and the base model, each with why (markdown)."""
    why = {c.setting: c.why for c in plan.proposal.choices}
    return [f"**Method: {METHODS[plan.method].title}** — {md_escape(why['method'])}",
            f"**Base model: {md_escape(plan.base_model)}** — {md_escape(why['base_model'])}"]


def estimate_metrics(plan: AgentPlan, price: float | None = None) -> list[tuple[str, str]]:
    """(label, value) of the estimate: steps, rows, tokens, memory, time and cost ("not measured yet" where the agent
    has no speed; "no price set" where price, the device-hour price given, is None)."""
    e = plan.estimate
    rows = (f"{e.train_rows:,} prompts" if plan.method == "rft" else f"{e.train_rows:,} / {e.eval_rows:,}")
    out = [("Steps", f"{e.total_steps:,}"),
           ("Rows" if plan.method == "rft" else "Rows (train / held out)", rows),
           ("Prompt tokens" if plan.method == "rft" else "Tokens", f"{e.tokens:,}"),
           ("Memory", f"{mib(e.memory_bytes)} ({e.device})"),
           ("Time", duration(e.seconds) if e.seconds is not None else "not measured yet")]
    if e.cost is not None:
        out.append(("Cost", f"{e.cost:,.2f}"))
    else:
        out.append(("Cost", "no price set" if price is None else "needs the time"))
    return out


def estimate_note(plan: AgentPlan) -> str:
    e = plan.estimate
    if e.throughput is not None:
        return f"Time from {md_escape(e.throughput.describe())}, plus its startup."
    if plan.method == "rft":
        return ("An RL step's time is its sampling, which no plan knows beforehand: the time shows once a finished "
                "RFT job on this base model with the same prompts per step, group size and max tokens has measured "
                "it. Tokens are the prompts' over the planned passes; memory is the training side's.")
    return ("Time and cost need a measured speed: finish one job of this method on this base model, or tick "
            "'Measure the speed' to run a short calibration job.")


def read_edits(plan: AgentPlan, texts: dict[str, str]) -> tuple[dict[str, Any], list[tuple[str, str]]]:
    """The settings the user changed (name -> value of the declared type) and the texts that are not values of it
    ((label, reason)); bounds are the server's to check."""
    changed: dict[str, Any] = {}
    problems: list[tuple[str, str]] = []
    declared = fields(plan)
    for name, text in texts.items():
        f, text = declared[name], text.strip()
        if text == format_value(plan.settings.get(name)):
            continue
        try:
            value = _parse(f, text)
        except ValueError:
            problems.append((f.setting.label, f"not a {_kind(f)}: {text!r}"))
            continue
        value, reason = check_value(f, value)
        if reason:
            problems.append((f.setting.label, reason))
        else:
            changed[name] = value
    return changed, problems


def _parse(f: Field, text: str) -> Any:
    if f.type is bool:
        if text.lower() not in ("true", "false"):
            raise ValueError(text)
        return text.lower() == "true"
    if f.type is int:
        return int(text)
    if f.type is float:
        return float(text)
    if f.is_list:
        return tuple(t.strip() for t in text.split(",") if t.strip())
    return text


def _kind(f: Field) -> str:
    return {bool: "true or false", int: "whole number", float: "number"}.get(f.type, "value")


def sweep_frame(jobs: list[pb.Job], result: SweepResult | None = None) -> pd.DataFrame:
    """One line per variant: job, learning rate, status, and once finished its final losses and problems."""
    rows = {r["job_id"]: r for r in (result.rows if result else [])}
    out = []
    for j in jobs:
        r = rows.get(j.id, {})
        d = r.get("diagnosis")
        out.append({"job": j.id, "learning rate": f"{getattr(j.spec, j.spec.WhichOneof('config')).learning_rate:g}",
                    "status": status_name(j.status), "final train loss": r.get("train_loss"),
                    "final held-out loss": r.get("eval_loss"),
                    "problems": ", ".join(d.problems) if d is not None else "",
                    "winner": "yes" if result is not None and result.winner is not None
                    and result.winner.id == j.id else ""})
    return pd.DataFrame(out)
