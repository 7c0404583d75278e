"""The Training Agent: a task description and an uploaded data set in, a plan to approve out; then the job, or a
small sweep and its winner.

A client of the scheduler's APIs (trainyard.Client), as any user's program: it reads the data set's rows and format,
the models and devices the account can use, asks PlanJob for the exact numbers of the proposed job (tokens, steps,
held-out rows, device memory), and measures throughput from the account's own finished jobs on the same base model
(or from a short calibration job when there is none), so the time and cost it shows are measured, not guessed.
The choices themselves are rules.py's, each with its reason. No LLM is needed; given a drafting model (any deployment
the account serves, drafting.py) the agent also asks it for the RFT evaluator (used only when it passes its test in
the sandbox) and for the plan in plain words. Nothing is created before approve() or sweep(), except the
short calibration job that measures the speed when no finished job does (calibrate=True, the default).

    agent = TrainingAgent(client)
    plan = agent.plan("Answer customer questions about our product", dataset_id)
    print(plan.render())            # method, model, settings with "why", estimates, warnings
    job = agent.approve(plan)       # or: result = agent.sweep(plan); result.winner, result.reason
"""
from __future__ import annotations

import json
import re
import secrets
import time
from dataclasses import dataclass, field, replace
from typing import Any

from services.planner import drafting, rules
from services.planner.diagnose import Diagnosis, diagnose
from trainyard.client import Client, format_name, status_name
from trainyard.v1 import scheduler_pb2 as pb

CALIBRATION_STEPS = 6
SWEEP_FACTORS = (0.5, 1.0, 2.0)
# Learning-rate factors of a sweep of n variants (the plan's own rate, and rates around it).
SWEEPS = {2: (0.5, 1.0), 3: SWEEP_FACTORS, 4: (0.25, 0.5, 1.0, 2.0)}
EVALUATOR_TEST_ROWS = drafting.TEST_ROWS
# The metric a job logs its work in, per unit of Throughput: SFT's target tokens, DPO's pairs, an RL job's steps.
_WORK = {"target tokens": "train/tokens", "pairs": "train/pairs", "steps": "train/loss"}
# A sweep's jobs are named after the plan and the sweep, each with its learning rate:
# "<_job_name(plan)>-s<4 hex digits>-lr<rate>"; the part before "-lr" names the sweep.
_SWEEP_NAME = re.compile(r"(agent-[a-z]+.*-s[0-9a-f]{4})-lr([0-9.e+-]+)")


@dataclass(frozen=True)
class Throughput:
    per_s: float  # units of work per second of training steps
    startup_s: float  # from the job's start to its first step
    source: str  # which job it was measured on
    unit: str = "target tokens"  # SFT: tokens carrying the loss; DPO: "pairs" (chosen + rejected)

    def describe(self) -> str:
        return f"{self.per_s:,.{0 if self.per_s >= 100 else 2}f} {self.unit}/s measured on {self.source}"


@dataclass
class Estimate:
    total_steps: int
    train_rows: int
    eval_rows: int
    tokens: int  # forward-pass tokens over the whole run
    target_tokens: int  # of them, those carrying the loss
    memory_bytes: int
    device: str
    seconds: float | None  # None: not measured yet
    cost: float | None  # None: no device-hour price given
    throughput: Throughput | None


@dataclass
class AgentPlan:
    description: str
    dataset_id: str
    proposal: rules.Proposal
    estimate: Estimate
    warnings: list[str] = field(default_factory=list)
    summary: str = ""  # the plan in plain words, by the drafting model
    drafted_by: str = ""  # the drafting model, when one was asked
    drafting_notes: list[str] = field(default_factory=list)  # what the drafting model's texts became, and why

    @property
    def method(self) -> str:
        return self.proposal.method

    @property
    def base_model(self) -> str:
        return self.proposal.base_model

    @property
    def settings(self) -> dict[str, Any]:
        return self.proposal.settings

    def with_settings(self, **changes: Any) -> AgentPlan:
        """The same plan with settings changed by the user (the estimate is then stale: plan again)."""
        return replace(self, proposal=replace(self.proposal, settings={**self.settings, **changes}))

    def render(self) -> str:
        why = {c.setting: c.why for c in self.proposal.choices}
        lines = [f"method: {self.method} ({why['method']})", f"base model: {self.base_model} ({why['base_model']})"]
        lines += [f"  {c.setting} = {c.value}: {c.why}" for c in self.proposal.choices
                  if c.setting not in ("method", "base_model")]
        e = self.estimate
        lines.append(f"estimate: {e.total_steps} steps over {e.train_rows} rows ({e.eval_rows} held out), "
                     f"{e.tokens:,} tokens, about {e.memory_bytes / 2**20:,.0f} MiB on {e.device}")
        if e.seconds is not None:
            lines.append(f"  time about {duration(e.seconds)} at {e.throughput.describe()}"
                         + (f"; cost about {e.cost:.2f}" if e.cost is not None else ""))
        lines += [f"warning: {w}" for w in self.warnings]
        if self.summary:
            lines.append(f"in plain words ({self.drafted_by}): {self.summary}")
        lines += [f"drafting: {n}" for n in self.drafting_notes]
        return "\n".join(lines)


@dataclass
class SweepResult:
    jobs: list[pb.Job]
    winner: pb.Job | None
    reason: str
    rows: list[dict[str, Any]]  # per variant: job id, learning rate, final train / held-out loss, diagnosis


class TrainingAgent:
    def __init__(self, client: Client, *, device_hour_cost: float | None = None, calibrate: bool = True,
                 drafter: str | None = None):
        """drafter: a deployment (or base model) that drafts the RFT evaluator and the plan's summary; None: rules
        only."""
        self.client = client
        self.device_hour_cost = device_hour_cost
        self.calibrate = calibrate
        self.drafter = drafting.Drafter(client, drafter) if drafter else None

    # -- facts --------------------------------------------------------------------------------------------------
    def data_facts(self, dataset_id: str) -> rules.DataFacts:
        ds = self.client.get_dataset(dataset_id)
        rows = self.client.preview_dataset(dataset_id, 0, rules.SAMPLE_ROWS)
        fields = tuple(sorted({k for r in rows for k in r}))
        longest = max((len(json.dumps(r, ensure_ascii=False)) for r in rows), default=0)
        return rules.DataFacts(format=format_name(ds.format), num_rows=ds.num_rows, fields=fields,
                               longest_row_chars=longest, rows=tuple(rows[:20]))

    def model_facts(self) -> list[rules.ModelFacts]:
        return [rules.ModelFacts(m.name, m.num_parameters, m.hidden_size, m.max_position_embeddings, m.architecture)
                for m in self.client.list_models()]

    def device_facts(self) -> rules.DeviceFacts:
        devices = [d for d in self.client.list_devices().devices if d.live]
        gpus = [d for d in devices if d.kind == "gpu"]
        if gpus:
            return rules.DeviceFacts("cuda", max(d.memory_bytes for d in gpus))
        memory = max((d.memory_bytes for d in devices), default=0) or 8 * 2**30
        return rules.DeviceFacts("cpu", memory)

    # -- planning -----------------------------------------------------------------------------------------------
    def plan(self, description: str, dataset_id: str, *, base_model: str | None = None, method: str | None = None,
             settings: dict[str, Any] | None = None) -> AgentPlan:
        """Propose a job for the data set and price it with PlanJob and measured throughput. settings: the user's
        own values, kept over the rules' (each choice then says so)."""
        if not description.strip():
            raise rules.PlanningError("describe the task in a sentence or two (what the model should do)")
        data = self.data_facts(dataset_id)
        proposal = rules.propose(description, data, self.model_facts(), self.device_facts(), base_model=base_model,
                                 method=method)
        for key, value in (settings or {}).items():
            proposal.settings[key] = value
            proposal.choices = [c for c in proposal.choices if c.setting != key] + [
                rules.Choice(key, value, "you set it")]
        notes = []
        if self.drafter is not None and proposal.method == "rft":
            notes.append(self._draft_evaluator(description, data, proposal))
        return self._drafted(self._priced(description, dataset_id, proposal), notes)

    def replan(self, plan: AgentPlan) -> AgentPlan:
        """Price a plan again after its settings were edited."""
        kept = [n for n in plan.drafting_notes if n.startswith("evaluator: ")]
        return self._drafted(self._priced(plan.description, plan.dataset_id, plan.proposal), kept)

    def _draft_evaluator(self, description: str, data: rules.DataFacts, proposal: rules.Proposal) -> str:
        """Ask the drafting model for the evaluator; it replaces the rules' one only when it passed its test."""
        truth = rules.truth_field(data.fields)
        drafted = self.drafter.evaluator(description, list(data.rows), truth, proposal.evaluator_source)
        if drafted.source:
            proposal.evaluator_source = drafted.source
            proposal.choices = [c for c in proposal.choices if c.setting != "evaluator"] + [
                rules.Choice("evaluator", "drafted", f"{drafted.reason}; read it, test it on rows and edit it before "
                                                     "approving")]
            return f"evaluator: {drafted.reason}"
        return f"evaluator: the rules' draft is shown ({drafted.reason})"

    def _drafted(self, plan: AgentPlan, notes: list[str]) -> AgentPlan:
        """The priced plan with the drafting model's summary of it (when there is a drafting model)."""
        if self.drafter is None:
            return plan
        plan.drafted_by = self.drafter.model
        plan.summary, problem = self.drafter.summary(plan.render())
        plan.drafting_notes = notes + ([f"summary: none ({problem})"] if problem else [])
        return plan

    def _priced(self, description: str, dataset_id: str, proposal: rules.Proposal) -> AgentPlan:
        settings = {k: v for k, v in proposal.settings.items() if k != "evaluator"}
        warnings = list(proposal.warnings)
        # The drafted evaluator is not uploaded before approval; which evaluator scores changes none of the plan's
        # numbers, so PlanJob is asked with a built-in one.
        planned = {**settings, "evaluator": "builtin:exact_match"} if proposal.method == "rft" else settings
        job_plan = self.client.plan_job(proposal.method, proposal.base_model, dataset_id, **planned)
        warnings += [w for w in job_plan.warnings if w not in warnings]
        epochs = max(job_plan.epochs, 0.0)
        target_tokens = int(job_plan.target_tokens_per_epoch * epochs)
        if proposal.method == "rft":
            throughput = self.rft_speed(proposal.base_model, settings)
        else:
            throughput = self.throughput(proposal.base_model, proposal.method, dataset_id)
        # The work the run does, in the unit its speed was measured in: target tokens, DPO's pairs, RFT's steps.
        work = {"pairs": job_plan.train_rows * epochs, "steps": job_plan.total_steps}.get(
            throughput.unit if throughput else "", target_tokens)
        seconds = cost = None
        if throughput is not None and throughput.per_s > 0:
            seconds = throughput.startup_s + work / throughput.per_s
            if self.device_hour_cost is not None:
                cost = seconds / 3600 * self.device_hour_cost
        e = Estimate(job_plan.total_steps, job_plan.train_rows, job_plan.eval_rows,
                     int(job_plan.tokens_per_epoch * epochs), target_tokens, job_plan.memory.total_bytes,
                     job_plan.memory.device, seconds, cost, throughput)
        return AgentPlan(description, dataset_id, proposal, e, warnings)

    def rft_speed(self, base_model: str, settings: dict[str, Any]) -> Throughput | None:
        """Steps per second of the account's latest finished RFT job on this base model whose steps are the same
        size (prompts per step, group size, max tokens): an RL step's time is its sampling, which no plan can
        know beforehand. None when there is no such job (no calibration: an RFT job needs an evaluator)."""
        shape = ("prompts_per_step", "group_size", "max_tokens")
        for job in self.client.list_jobs(status="succeeded"):
            if (job.spec.base_model == base_model and _method(job) == "rft"
                    and all(_setting(job, k) == settings.get(k) for k in shape)):
                measured = self._measured(job, "steps")
                if measured is not None:
                    return measured
        return None

    def throughput(self, base_model: str, method: str, dataset_id: str) -> Throughput | None:
        """Target tokens (DPO: pairs) per second of the account's latest finished job on this base model and method
        (training steps only), else of a short calibration job run now (when calibrate is set)."""
        unit = "pairs" if method == "dpo" else "target tokens"
        for job in self.client.list_jobs(status="succeeded"):
            if job.spec.base_model == base_model and _method(job) == method:
                measured = self._measured(job, unit)
                if measured is not None:
                    return measured
        if not self.calibrate:
            return None
        settings = {"max_steps": CALIBRATION_STEPS, "checkpoint_every": 10_000, "eval_fraction": 0.0}
        if method == "dpo":
            settings["beta"] = 0.1
        job = self.client.create_job(method, base_model, dataset_id, "agent-calibration", **settings)
        done = self.client.wait_job(job.id, timeout_s=1800)
        if done.status != pb.JOB_STATUS_SUCCEEDED:
            raise rules.PlanningError(f"the calibration job {job.id} {status_name(done.status)}: {done.error}")
        return self._measured(done, unit)

    def _measured(self, job: pb.Job, unit: str) -> Throughput | None:
        """The job's speed in unit (_WORK: the metric each step logs it in; a step is worth one "steps")."""
        key = _WORK[unit]
        points = [p for p in self.client.job_metrics(job.id) if key in p.values]
        if len(points) < 3:
            return None
        t = [p.time.ToDatetime().timestamp() for p in points]
        # The first step pays for loading and compiling: time from it to the last one, work after it.
        elapsed = t[-1] - t[0]
        work = len(points) - 1 if unit == "steps" else sum(p.values[key] for p in points[1:])
        if elapsed <= 0 or work <= 0:
            return None
        startup = max(0.0, t[0] - job.started_at.ToDatetime().timestamp()) if job.HasField("started_at") else 0.0
        return Throughput(work / elapsed, startup, f"job {job.id} ({job.spec.display_name or _method(job)})", unit)

    # -- acting -------------------------------------------------------------------------------------------------
    def approve(self, plan: AgentPlan, display_name: str = "") -> pb.Job:
        """Create the planned job (RFT: upload the drafted, possibly edited, evaluator first)."""
        settings = dict(plan.settings)
        if plan.method == "rft":
            ev = self.client.upload_evaluator(plan.proposal.evaluator_source.encode(), _evaluator_name(plan))
            settings["evaluator"] = f"{ev.name}@{ev.version}"
        return self.client.create_job(plan.method, plan.base_model, plan.dataset_id,
                                      display_name or _job_name(plan), **settings)

    def sweep(self, plan: AgentPlan, factors: tuple[float, ...] = SWEEP_FACTORS, *, wait: bool = True,
              timeout_s: float = 7200) -> SweepResult:
        """2-4 variants of the plan's learning rate (x factors), each with the held-out evaluation, and the winner:
        the lowest final held-out loss among those that did not overfit or diverge."""
        if not 2 <= len(factors) <= 4:
            raise rules.PlanningError(f"factors: a sweep runs 2 to 4 variants, got {len(factors)}")
        if plan.method == "rft":
            raise rules.PlanningError("a sweep compares held-out losses, which RFT jobs do not have: approve the "
                                      "plan instead")
        base_lr = plan.settings["learning_rate"]
        sweep = f"{_job_name(plan)}-s{secrets.token_hex(2)}"
        jobs = []
        for f in factors:
            variant = plan.with_settings(learning_rate=float(f"{base_lr * f:.2g}"))
            jobs.append(self.approve(variant, f"{sweep}-lr{variant.settings['learning_rate']:g}"))
        if not wait:
            return SweepResult(jobs, None, "running", [])
        deadline = time.monotonic() + timeout_s
        finished = [self.client.wait_job(j.id, timeout_s=max(1.0, deadline - time.monotonic())) for j in jobs]
        return self.pick_winner(finished)

    def sweeps(self) -> dict[str, list[pb.Job]]:
        """The account's sweeps, found again from their jobs' names (they run on the server whoever watches):
        the sweep's name -> its jobs, in learning-rate order; newest sweep first."""
        found: dict[str, list[pb.Job]] = {}
        for job in self.client.list_jobs():
            m = _SWEEP_NAME.fullmatch(job.spec.display_name)
            if m:
                found.setdefault(m.group(1), []).append(job)
        return {name: sorted(jobs, key=lambda j: _setting(j, "learning_rate") or 0.0)
                for name, jobs in found.items() if len(jobs) >= 2}

    def test_evaluator(self, plan: AgentPlan, source: str,
                       num_rows: int = EVALUATOR_TEST_ROWS) -> pb.EvaluatorTestResponse:
        """The (edited) drafted evaluator of an RFT plan in the server's sandbox, before approval: run, and stored
        nowhere, on the data set's first num_rows rows, each with its expected answer (the ground-truth field the
        evaluator was drafted from) as the completion, so a right reward_fn scores 1 on every row. approve() uploads
        what is approved."""
        rows = self.client.preview_dataset(plan.dataset_id, 0, num_rows)
        truth = rules.truth_field(tuple(sorted({k for r in rows for k in r})))
        return drafting.score_own_answers(self.client, source, rows, truth)

    def pick_winner(self, jobs: list[pb.Job]) -> SweepResult:
        rows = []
        for job in jobs:
            points = self.client.job_metrics(job.id)
            d = diagnose(points)
            rows.append({"job_id": job.id, "status": status_name(job.status),
                         "learning_rate": _setting(job, "learning_rate"), "train_loss": d.final_train_loss,
                         "eval_loss": d.final_eval_loss, "diagnosis": d})
        candidates = [r for r in rows if r["status"] == "succeeded" and r["eval_loss"] is not None]
        if not candidates:
            return SweepResult(jobs, None, "no variant finished with a held-out loss", rows)
        healthy = [r for r in candidates if not r["diagnosis"].problems]
        pool = healthy or candidates
        best = min(pool, key=lambda r: r["eval_loss"])
        others = ", ".join(f"lr {r['learning_rate']:g}: {r['eval_loss']:.4f}" for r in candidates if r is not best)
        reason = (f"lr {best['learning_rate']:g} has the lowest final held-out loss, {best['eval_loss']:.4f}"
                  + (f" (others: {others})" if others else ""))
        excluded = [r for r in candidates if r["diagnosis"].problems]
        if healthy and excluded:
            reason += "; excluded: " + "; ".join(f"lr {r['learning_rate']:g} ({', '.join(r['diagnosis'].problems)})"
                                                 for r in excluded)
        elif not healthy:
            reason += "; every variant shows a problem: " + "; ".join(
                f"lr {r['learning_rate']:g} ({', '.join(r['diagnosis'].problems)})" for r in candidates)
        winner = next(j for j in jobs if j.id == best["job_id"])
        return SweepResult(jobs, winner, reason, rows)


def _method(job: pb.Job) -> str:
    return job.spec.WhichOneof("config") or ""


def _setting(job: pb.Job, name: str) -> Any:
    config = getattr(job.spec, _method(job))
    return getattr(config, name, None)


def _job_name(plan: AgentPlan) -> str:
    words = [w for w in "".join(ch if ch.isalnum() else " " for ch in plan.description.lower()).split()][:4]
    return "-".join(["agent", plan.method, *words])[:60]


def _evaluator_name(plan: AgentPlan) -> str:
    return f"agent-{plan.dataset_id}"[:64]


def duration(seconds: float) -> str:
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


__all__ = ["AgentPlan", "Diagnosis", "Estimate", "SweepResult", "Throughput", "TrainingAgent"]
