"""kill -9 of every service at random points of a managed job and of a Training API loop.

Each runs twice on its own stack: undisturbed (the reference), then with every service SIGKILLed at a step drawn at
random (`scale.fault_rounds` times each) and restarted at once. The disturbed run must end with weights bitwise equal
to the reference (the reaper retries a job whose worker died from its last checkpoint; a Training API client retries
a SaveWeights whose publish found weight sync down, as trainer.proto allows), and threads sampling a deployment
throughout may see errors only while the rollout is down. A killed trainer's session continues under the same id from
its last recorded state (the loop saves its state after every step, so nothing is lost).
"""
from __future__ import annotations

import random
import time
from collections import defaultdict

import grpc
import pytest
from sqlalchemy import create_engine, text

from tests.conftest import create_account
from tests.integration.data import chat_rows, jsonl
from tests.reliability.chaos import RECONNECT_SLACK_S, Chaos, Traffic
from tests.reliability.conftest import drop_db, new_stack
from tests.reliability.figures import FIGURES
from tests.reliability.world import BASE, SEQ, Account, Stubs, datum, wait_loaded
from trainyard import Client, ServiceClient, types
from trainyard.v1 import common_pb2
from trainyard.v1 import rollout_pb2 as rpb
from trainyard.v1 import scheduler_pb2 as spb
from trainyard.v1 import scheduler_pb2_grpc as sg
from trainyard.v1 import trainer_pb2 as tpb

pytestmark = [pytest.mark.reliability, pytest.mark.integration, pytest.mark.slow]

SERVICES = ("scheduler", "worker", "trainer", "rollout", "weightsync")
JOB = {"learning_rate": 3e-3, "batch_size": 4, "eval_fraction": 0.2, "seed": 7, "checkpoint_every": 10}
ADAM = tpb.AdamParams(learning_rate=1e-2)
PROMPT = [5, 17, 33, 60]


@pytest.fixture(scope="module")
def fstack(tmp_path_factory, redis_url, scale):
    # Every worker kill is one more attempt of the job.
    stack = new_stack(tmp_path_factory.mktemp("faults"), redis_url,
                      {"TRAINYARD_MAX_JOB_ATTEMPTS": str(scale.fault_rounds + 2)})
    try:
        yield stack
    finally:
        stack.down()
        drop_db(stack)


@pytest.fixture(scope="module")
def fstubs(fstack):
    s = Stubs(fstack)
    yield s
    s.close()


@pytest.fixture(scope="module")
def acct(fstack):
    return Account(name="faults", key=create_account(fstack.env_for("scheduler"), "faults"))


@pytest.fixture(scope="module")
def client(fstack, acct):
    with Client(url=fstack.url("scheduler"), rollout_url=fstack.url("rollout"), api_key=acct.key) as c:
        yield c


def sampler(fstubs, acct, model: str) -> Traffic:
    request = rpb.SampleRequest(model=model, tokens=common_pb2.TokenList(tokens=PROMPT),
                                params=rpb.SamplingParams(max_tokens=4, temperature=0))
    return Traffic(lambda: fstubs.rollout.Sample(request, metadata=acct.md, timeout=60), threads=2, name="sampler")


def kill_plan(rng: random.Random, services, rounds: int, first: int, last: int) -> list[tuple[int, str]]:
    """(step, service) for every kill, in step order: each service `rounds` times at a random step in [first, last]."""
    return sorted((rng.randint(first, last), s) for s in services for _ in range(rounds))


def files_of(fstubs, acct, checkpoint_id: str) -> dict[str, str]:
    """The checkpoint's files and their sha256 (waiting for a restarted scheduler to be reachable)."""
    checkpoint = sg.CheckpointServiceStub(fstubs.channels["scheduler"]).GetCheckpoint(
        spb.GetCheckpointRequest(id=checkpoint_id), metadata=acct.md, timeout=60, wait_for_ready=True)
    return {f.path: f.sha256 for f in checkpoint.files}


def check_sampling(traffic: Traffic, chaos: Chaos, what: str, needs: tuple[str, ...] = ()) -> dict:
    """Sampling errors only while the rollout was down (or, after its restart, while a service it loads the sampled
    deployment from was: `needs`)."""
    stray = traffic.errors_outside(chaos.outages("rollout", RECONNECT_SLACK_S, needs))
    errors = [c for c in traffic.calls if c.code != "OK"]
    assert not stray, (f"{what}: {len(stray)} sampling errors while the rollout was up: "
                       f"{sorted({c.code for c in stray})}")
    return {"sample_calls": len(traffic.calls), "sample_errors": len(errors),
            "sample_errors_outside_outages": len(stray)}


def test_managed_job_survives_kill_9_of_every_service(fstack, client, fstubs, acct, scale):
    steps = 300 * scale.fault_rounds
    ds, _ = client.upload_dataset(jsonl(chat_rows(16)), name="faults")
    reference = client.wait_job(client.create_sft_job(BASE, ds.id, "reference", max_steps=steps, **JOB).id, 900)
    assert reference.error == "", reference.error
    deployment = client.create_deployment("faults-reference", checkpoint_id=reference.output_checkpoint_id)
    wait_loaded(fstubs, acct, deployment.name)

    rng = random.Random()
    plan = kill_plan(rng, SERVICES, scale.fault_rounds, steps // 20, steps * 3 // 4)
    chaos, traffic = Chaos(fstack), sampler(fstubs, acct, deployment.name).start()
    job = client.create_sft_job(BASE, ds.id, "disturbed", max_steps=steps, **JOB)
    engine = create_engine(fstack.database_url)
    killed_mid_job = []
    try:
        for step, service in plan:  # the job's progress read from the database: the scheduler may be down
            row = wait_for(lambda: job_row(engine, job.id),
                           lambda r, step=step: r.step >= step or r.status not in ("queued", "running"), 600)
            if row.status in ("queued", "running"):
                chaos.kill(service)
                killed_mid_job.append((step, service))
        done = wait_for(lambda: job_row(engine, job.id), lambda r: r.status in ("succeeded", "failed", "cancelled"),
                        900)
        chaos.join()
        traffic.wait_ok_after(max(f.ready_at for f in chaos.faults))
    finally:
        traffic.stop()
        chaos.join()
        engine.dispose()
    finished = sg.JobServiceStub(fstubs.channels["scheduler"]).GetJob(spb.GetJobRequest(id=job.id), metadata=acct.md,
                                                                       timeout=60, wait_for_ready=True)
    assert done.status == "succeeded", finished.error
    assert killed_mid_job == plan, f"the job ended before every kill: {killed_mid_job} of {plan}"
    assert files_of(fstubs, acct, finished.output_checkpoint_id) == \
        files_of(fstubs, acct, reference.output_checkpoint_id), "the disturbed job's weights differ from the reference's"
    FIGURES["faults_managed_job"] = {"steps": steps, "kills": [f"{s}@{step}" for step, s in plan],
                                     "attempts": done.attempts, "bitwise_equal": True,
                                     **check_sampling(traffic, chaos, "managed job")}


def job_row(engine, job_id: str):
    with engine.connect() as conn:
        return conn.execute(text("SELECT status, step, attempts FROM jobs WHERE id = :id"), {"id": job_id}).one()


def wait_for(get, done, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = get()
        if done(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s}s; last: {value}")


def train(fstubs, acct, session_id: str, steps: int, on_step=lambda i: None) -> tpb.SaveWeightsResponse:
    """A Training API loop on raw stubs: forward-backward, optimizer step and SaveWeights (published to the session's
    lineage) per step. A SaveWeights that finds weight sync down answers UNAVAILABLE, uses up its seq_id and changes
    nothing (trainer.proto), so it is sent again."""
    saved = None
    for i in range(steps):
        on_step(i)
        fstubs.trainer.ForwardBackward(tpb.ForwardBackwardRequest(session_id=session_id, data=[datum(SEQ)]),
                                       metadata=acct.md, timeout=120)
        fstubs.trainer.OptimStep(tpb.OptimStepRequest(session_id=session_id, adam=ADAM), metadata=acct.md,
                                 timeout=120)
        deadline = time.monotonic() + 300
        while True:
            try:
                saved = fstubs.trainer.SaveWeights(tpb.SaveWeightsRequest(session_id=session_id, name=f"step-{i}"),
                                                   metadata=acct.md, timeout=120)
                break
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    return saved


def new_session(fstubs, acct) -> str:
    return fstubs.trainer.CreateSession(tpb.CreateSessionRequest(base_model=BASE, lora=tpb.SessionLora(rank=8),
                                                                 seed=11), metadata=acct.md).id


def wait_serving(fstubs, acct, deployment: str, version_id: str, timeout_s: float = 120) -> None:
    """Until the deployment serves version_id (a Sample, which also loads a deployment a restarted rollout lost; the
    channel may still be waiting out its reconnect backoff to a restarted rollout)."""
    request = rpb.SampleRequest(model=deployment, tokens=common_pb2.TokenList(tokens=PROMPT),
                                params=rpb.SamplingParams(max_tokens=1))

    def served() -> str:
        try:
            return fstubs.rollout.Sample(request, metadata=acct.md, timeout=60, wait_for_ready=True).weight_version_id
        except grpc.RpcError as exc:
            return exc.code().name

    wait_for(served, lambda v: v == version_id, timeout_s)


def test_training_loop_survives_kill_9_of_the_other_services(fstack, client, fstubs, acct, scale):
    steps = 40 * scale.fault_rounds
    reference = train(fstubs, acct, new_session(fstubs, acct), steps)

    session = new_session(fstubs, acct)
    first = train(fstubs, acct, session, 1)
    follower = client.create_deployment("faults-follower", lineage=session)
    wait_serving(fstubs, acct, follower.name, first.version_id)
    plan = kill_plan(random.Random(), [s for s in SERVICES if s != "trainer"], scale.fault_rounds, 0, steps - 2)
    at_step = defaultdict(list)
    for step, service in plan:
        at_step[step].append(service)
    chaos, traffic = Chaos(fstack), sampler(fstubs, acct, follower.name).start()
    try:
        final = train(fstubs, acct, session, steps - 1,
                      on_step=lambda i: [chaos.kill(service) for service in at_step[i]])
        chaos.join()
        wait_serving(fstubs, acct, follower.name, final.version_id)
        traffic.wait_ok_after(max(f.ready_at for f in chaos.faults))
    finally:
        traffic.stop()
        chaos.join()
    assert files_of(fstubs, acct, final.checkpoint_id) == files_of(fstubs, acct, reference.checkpoint_id), \
        "the disturbed loop's weights differ from the reference's"
    FIGURES["faults_training_loop"] = {"steps": steps, "kills": [f"{s}@{i + 1}" for i, s in plan],
                                       "bitwise_equal": True, "follower_on_final_version": True,
                                       **check_sampling(traffic, chaos, "training loop", needs=("weightsync",))}


def test_training_session_survives_kill_9_of_the_trainer(fstack, client, fstubs, acct, scale):
    """The SDK's loop (save_state after every step) goes on through trainer kills with the same session, ends with
    the reference's weights, and the deployment following the session follows its last version."""
    steps = 20
    with ServiceClient(base_url=fstack.url("trainer"), api_key=acct.key, rollout_url=fstack.url("rollout")) as svc:
        def loop(tc, on_step=lambda i: None):
            data = [types.Datum(types.ModelInput.from_ints(SEQ[:-1]),
                                {"target_tokens": SEQ[1:], "weights": [1.0] * (len(SEQ) - 1)})]
            for i in range(steps):
                on_step(i)
                tc.forward_backward(data, "cross_entropy").result()
                tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
                tc.save_state(f"step-{i}").result()
            return tc.save_weights_for_sampler("final").result()

        reference = loop(svc.create_lora_training_client(BASE, rank=8, seed=13).result())
        tc = svc.create_lora_training_client(BASE, rank=8, seed=13).result()
        start = tc.save_weights_for_sampler("start").result()
        follower = client.create_deployment("faults-trainer-follower", lineage=tc.model_id)
        wait_serving(fstubs, acct, follower.name, start.version_id)
        kills = set(random.Random().sample(range(1, steps), scale.fault_rounds))
        chaos = Chaos(fstack)
        traffic = sampler(fstubs, acct, follower.name).start()
        try:
            final = loop(tc, on_step=lambda i: i in kills and chaos.kill("trainer"))
            chaos.join()
            assert tc.get_info().model_id == tc.model_id
            wait_serving(fstubs, acct, follower.name, final.version_id)
        finally:
            traffic.stop()
            chaos.join()
    assert files_of(fstubs, acct, final.checkpoint_id) == files_of(fstubs, acct, reference.checkpoint_id)
    FIGURES["faults_trainer"] = {"steps": steps, "trainer_kills": sorted(kills), "bitwise_equal": True,
                                 **check_sampling(traffic, chaos, "trainer kills")}

