"""The Training Agent with a drafting model that Trainyard serves: a deployment's evaluator replaces the rules' one
only when it passes its test in the sandbox; one that does not (the untrained tiny model writes no code), or a model
that cannot be reached, leaves the rules' evaluator, and the plan says why.

The deployment that drafts a good evaluator is the tiny model taught, by an SFT job on this stack, to answer the
agent's own request for this data with one reward function: the real path (sample -> check -> sandbox -> plan), with
a model small enough for CPUs.
"""
from __future__ import annotations

import json

import pytest

from services.planner import drafting, rules
from services.planner.agent import TrainingAgent
from tests.conftest import create_account
from trainyard.v1 import scheduler_pb2 as pb

pytestmark = pytest.mark.integration

TASK = "Add the two numbers and answer with the sum."
ROWS = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)}
        for a, b in ((2, 3), (4, 5), (7, 1), (6, 6), (3, 9), (8, 2), (5, 5), (9, 4))]
# What the drafting deployment is taught to write: not the rules' draft, so the test can tell which one the plan has.
GOOD = ('def reward_fn(completion, row):\n    words = completion.split()\n'
        '    return 1.0 if words and words[-1] == str(row["answer"]) else 0.0\n')


def jsonl(rows: list[dict]) -> bytes:
    return "".join(json.dumps(r) + "\n" for r in rows).encode()


@pytest.fixture(scope="module")
def client(stack):
    from trainyard import Client

    key = create_account(stack.env_for("scheduler"), "agent-drafting")
    with Client(url=stack.url("scheduler"), rollout_url=stack.url("rollout"), api_key=key) as c:
        yield c


def test_a_deployment_drafts_the_evaluator_and_only_a_tested_one_is_used(client):
    c = client
    ds, _ = c.upload_dataset(jsonl(ROWS), name="sums")
    rules_only = TrainingAgent(c, calibrate=False).plan(TASK, ds.id)
    assert rules_only.method == "rft" and rules_only.drafted_by == "" and not rules_only.drafting_notes
    rules_source = rules_only.proposal.evaluator_source

    # The drafting model: the tiny model taught to answer exactly the agent's request for this data with GOOD.
    data = TrainingAgent(c).data_facts(ds.id)
    request = drafting.evaluator_messages(TASK, list(data.rows), rules.truth_field(data.fields), rules_source)
    taught = [{"messages": [*request, {"role": "assistant", "content": f"```python\n{GOOD}```"}]}] * 8
    teach, _ = c.upload_dataset(jsonl(taught), name="drafter-lessons")
    job = c.create_job("sft", "tiny-qwen3", teach.id, "drafter", max_steps=80, learning_rate=5e-3, lora_rank=8,
                       batch_size=4, max_seq_len=1024, eval_fraction=0.0, checkpoint_every=80)
    done = c.wait_job(job.id, timeout_s=900)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
    c.create_deployment("drafter", job_id=job.id)

    plan = TrainingAgent(c, calibrate=False, drafter="drafter").plan(TASK, ds.id)
    print("\n" + plan.render())
    assert plan.proposal.evaluator_source == GOOD
    why = plan.proposal.why("evaluator")
    assert why.startswith("drafted by drafter") and "scored 1 on the first 5 rows" in why
    assert plan.drafting_notes[0].startswith("evaluator: drafted by drafter")
    assert plan.drafted_by == "drafter" and (plan.summary or "summary: none" in plan.drafting_notes[-1])
    assert plan.estimate.seconds is None and plan.estimate.memory_bytes > 0  # no RFT job has measured a step yet
    # The plan approves as any other: the drafted evaluator is what the job scores with.
    job = TrainingAgent(c, calibrate=False, drafter="drafter").approve(plan.with_settings(steps=4))
    evaluator = job.spec.rft.evaluator
    assert c.get_evaluator_source(evaluator).content.decode() == GOOD
    done = c.wait_job(job.id, timeout_s=900)
    assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
    # Its steps, of the same size as the plan's, now give RFT plans a time.
    timed = TrainingAgent(c, calibrate=False).plan(TASK, ds.id)
    assert timed.estimate.throughput.unit == "steps" and done.id in timed.estimate.throughput.source
    assert timed.estimate.seconds > timed.estimate.throughput.startup_s

    # The untrained base model answers with no usable code: the rules' evaluator stays, with the reason.
    plan = TrainingAgent(c, calibrate=False, drafter="tiny-qwen3").plan(TASK, ds.id)
    assert plan.proposal.evaluator_source == rules_source
    assert plan.drafting_notes[0].startswith("evaluator: the rules' draft is shown (tiny-qwen3's draft was not "
                                             "used: ")
    assert plan.proposal.why("evaluator") == rules_only.proposal.why("evaluator")

    # A model nobody serves: the plan is the rules', and says the drafting model could not be reached.
    plan = TrainingAgent(c, calibrate=False, drafter="no-such-deployment").plan(TASK, ds.id)
    assert plan.proposal.evaluator_source == rules_source and plan.summary == ""
    assert "no-such-deployment could not be reached (NOT_FOUND" in plan.drafting_notes[0]
    assert plan.drafting_notes[-1].startswith("summary: none (no-such-deployment could not be reached")
