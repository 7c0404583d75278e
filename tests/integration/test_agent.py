"""The Training Agent against the real services: it plans the sample data set (method, settings with reasons, PlanJob's
numbers, throughput measured by a calibration job), the approved job learns in about the time estimated, and a sweep
picks the variant with the lowest held-out loss."""
from __future__ import annotations

import pytest

from services.planner.agent import TrainingAgent
from services.planner.diagnose import diagnose
from tests.conftest import create_account
from trainyard.localstack import ROOT
from trainyard.v1 import scheduler_pb2 as pb

pytestmark = pytest.mark.integration

DATA = ROOT / "examples" / "data" / "sft_demo.jsonl"
TASK = "Answer customer questions about Trainyard the way our support team does"


@pytest.fixture(scope="module")
def agent_client(stack):
    from trainyard import Client

    key = create_account(stack.env_for("scheduler"), "agent-user")  # no jobs yet: the agent must calibrate
    with Client(url=stack.url("scheduler"), rollout_url=stack.url("rollout"), api_key=key) as c:
        yield c


def test_plan_approve_and_the_estimate_holds(agent_client):
    c = agent_client
    ds, _ = c.upload_dataset(DATA, name="support-faq")
    agent = TrainingAgent(c, device_hour_cost=2.0)
    plan = agent.plan(TASK, ds.id)
    print("\n" + plan.render())
    assert (plan.method, plan.base_model) == ("sft", "tiny-qwen3")
    e = plan.estimate
    assert e.total_steps == plan.settings["max_steps"] and e.eval_rows == 2 and e.train_rows == 18
    assert e.tokens > e.target_tokens > 0 and e.memory_bytes > 0
    assert e.throughput is not None and "agent-calibration" in e.throughput.source
    assert e.seconds is not None and e.seconds > 0 and e.cost == pytest.approx(e.seconds / 3600 * 2.0)
    calibration = [j for j in c.list_jobs() if j.spec.display_name == "agent-calibration"]
    assert len(calibration) == 1  # measured once ...
    again = agent.plan(TASK, ds.id)
    assert len([j for j in c.list_jobs() if j.spec.display_name == "agent-calibration"]) == 1  # ... then reused
    assert again.settings == plan.settings

    job = agent.approve(plan)
    done = c.wait_job(job.id, timeout_s=1200)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
    measured = done.finished_at.ToDatetime().timestamp() - done.started_at.ToDatetime().timestamp()
    print(f"estimated {e.seconds:.1f}s, measured {measured:.1f}s")
    # The same machine, the same model and data: the estimate is of the right size (not a timing assertion: a
    # loaded machine may be twice as slow as during calibration).
    assert e.seconds / 5 < measured < e.seconds * 5
    d = diagnose(c.job_metrics(job.id))
    assert "not learning" not in d.problems and "diverging" not in d.problems
    points = [p for p in c.job_metrics(job.id) if "train/loss" in p.values]
    assert points[-1].values["train/loss"] < 0.5 * points[0].values["train/loss"]


def test_sweep_picks_the_lowest_held_out_loss(agent_client):
    c = agent_client
    ds, _ = c.upload_dataset(DATA, name="support-faq-sweep")
    agent = TrainingAgent(c, calibrate=False)
    plan = agent.plan(TASK, ds.id, settings={"max_steps": 30, "eval_every": 10, "checkpoint_every": 30})
    assert plan.settings["max_steps"] == 30 and dict((ch.setting, ch.why) for ch in plan.proposal.choices)[
        "max_steps"] == "you set it"
    result = agent.sweep(plan, factors=(0.1, 1.0))
    print(result.reason)
    assert result.winner is not None and len(result.jobs) == 2
    losses = {r["job_id"]: r["eval_loss"] for r in result.rows}
    assert losses[result.winner.id] == min(losses.values())
    assert "lowest final held-out loss" in result.reason
    with pytest.raises(ValueError, match="2 to 4 variants"):
        agent.sweep(plan, factors=(1.0,))


def test_dpo_time_is_estimated_in_pairs_and_holds(agent_client):
    """DPO's speed is measured in pairs per second (its jobs log train/pairs): the estimate divides the plan's pairs,
    not its tokens, by it."""
    c = agent_client
    ds, _ = c.upload_dataset(ROOT / "examples" / "data" / "dpo_polite.jsonl", name="polite-pairs")
    agent = TrainingAgent(c)
    plan = agent.plan("Prefer the polite answer", ds.id, settings={"max_steps": 30})
    print("\n" + plan.render())
    e = plan.estimate
    assert plan.method == "dpo" and e.throughput is not None and e.throughput.unit == "pairs"
    assert "pairs/s measured on job" in plan.render()
    done = c.wait_job(agent.approve(plan).id, timeout_s=1200)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
    measured = done.finished_at.ToDatetime().timestamp() - done.started_at.ToDatetime().timestamp()
    print(f"estimated {e.seconds:.1f}s, measured {measured:.1f}s")
    assert e.seconds / 5 < measured < e.seconds * 5  # of the right size (tokens / pairs-per-s would be ~100x off)
