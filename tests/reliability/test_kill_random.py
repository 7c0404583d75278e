"""kill -9 at random points of every managed method: the job resumes from its last checkpoint with no lost or
duplicated steps, metrics, checkpoints or RL samples.

One stack of its own (scheduler and a Celery worker, trainyard/localstack.py, on a fresh Postgres database; RFT jobs
sample from their own rollout process, WorkerSettings.rft_rollout = process): an SFT
LoRA job, a DPO job, RFT jobs in sync and async mode, and an SFT job on a torchrun group of 2 ranks (the worker is
restarted with TRAINYARD_MANAGED_NPROC=2 for it). Each job is SIGKILLed once, two of the first four (drawn) twice;
the victim is the worker process (its process group: the rollout process and torchrun group with it), the RFT job's
rollout process, or one rank of the group. When to kill is drawn from a seeded RNG, from five kinds of point (KINDS),
every kind at least once in the module:

  before-first-checkpoint  while the model loads or within the steps before the first checkpoint
  mid-step                 a random fraction of a step after the job reported a random step
  checkpoint-write         as soon as the job reported a checkpoint step whose checkpoint row is not there yet
                           (the checkpoint is being written and stored)
  after-checkpoint         as soon as a checkpoint row appears
  uniform                  a delay drawn uniformly over the attempt's expected span

The job's progress is read from the database (polled every 20 ms), as the point needs. The seed comes from
TRAINYARD_KILL_SEED (else the clock); it is printed and in every assertion message, so
`TRAINYARD_KILL_SEED=<seed> pytest tests/reliability/test_kill_random.py` replays the same draws (the moments they
land on still depend on the machine's speed). Every job must succeed at step N with: steps 1..N each with exactly one
metric point; checkpoints at exactly the due steps (every checkpoint_every and N), each once, only the last final,
every file of each readable and matching its sha256; for RFT, the samples recorded in the checkpoints
(state/rl_samples.jsonl) of steps (previous checkpoint, this checkpoint] exactly, prompts_per_step x group_size
samples per step; and one attempt more than the kills.
"""
from __future__ import annotations

import json
import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass, field

import psutil
import pytest
from sqlalchemy import create_engine, text

from services.common.blobstore import BlobStore
from tests.conftest import create_account, own_stack
from tests.integration.data import chat_rows, jsonl
from tests.reliability.figures import FIGURES
from tests.services.trainer.trainer_helpers import PAIRS, preference_row
from trainyard import Client
from trainyard.v1 import scheduler_pb2 as pb

pytestmark = [pytest.mark.reliability, pytest.mark.integration, pytest.mark.slow]

SEED = int(os.environ.get("TRAINYARD_KILL_SEED") or time.time_ns() % 2**31)
KINDS = ("before-first-checkpoint", "mid-step", "checkpoint-write", "after-checkpoint", "uniform")
MODEL = "tiny-qwen3"
MAX_ATTEMPTS = 3  # two kills per job at most
EXTRA_KILLS = 2  # jobs killed twice (7 kills in all: each costs an attempt, a worker's about 15 s on 2 cores)
SFT = dict(learning_rate=3e-3, batch_size=4, eval_fraction=0.2, max_steps=8, checkpoint_every=3, seed=7)
DPO = dict(learning_rate=2e-3, batch_size=4, eval_fraction=0.2, max_seq_len=64, beta=0.2, max_steps=8,
           checkpoint_every=3)
RFT = dict(full_parameter=True, learning_rate=1e-3, prompts_per_step=4, group_size=4, max_tokens=4, steps=8,
           checkpoint_every=3, max_staleness=1)
GROUP = dict(max_steps=8, batch_size=2, gradient_accumulation_steps=2, checkpoint_every=3, eval_fraction=0.2,
             lora_rank=4, learning_rate=5e-3, max_seq_len=64, seed=5)
POLL_S = 0.02


def replay() -> str:
    return f"TRAINYARD_KILL_SEED={SEED}"


@dataclass
class Kill:
    kind: str
    victim: str
    attempt: int = 0
    seconds_into_attempt: float = 0.0
    step: int = 0                 # the job's recorded step when the signal went
    checkpoints: tuple = ()       # the job's checkpoint steps then
    note: str = ""

    def __str__(self) -> str:
        return (f"{self.victim}@{self.kind} (attempt {self.attempt}, {self.seconds_into_attempt:.1f} s in, step "
                f"{self.step}, checkpoints {list(self.checkpoints)}{', ' + self.note if self.note else ''})")


@dataclass
class Plan:
    """The kills of one job, in order: (kind, victim), drawn from the module's RNG."""

    kills: list[tuple[str, str]]
    rng: random.Random
    done: list[Kill] = field(default_factory=list)


@pytest.fixture(scope="module")
def kstack(tmp_path_factory, redis_url):
    env = {"TRAINYARD_HEARTBEAT_S": "0.5", "TRAINYARD_WORKER_LOST_AFTER_S": "6",
           "TRAINYARD_REAPER_INTERVAL_S": "1", "TRAINYARD_SHUTDOWN_GRACE_S": "3",
           "TRAINYARD_TORCH_THREADS": "1", "TRAINYARD_MAX_JOB_ATTEMPTS": str(MAX_ATTEMPTS),
           # No rollout or weight-sync service here: RFT jobs sample from a rollout process of their
           # own (one of the victims), whatever service addresses the worker is given.
           "TRAINYARD_RFT_ROLLOUT": "process"}
    with own_stack(tmp_path_factory.mktemp("killrand"), redis_url, "trainyard_killrand", env) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(kstack):
    key = create_account(kstack.env_for("scheduler"), "killrand")
    with Client(url=kstack.url("scheduler"), api_key=key) as c:
        yield c


@pytest.fixture(scope="module")
def db(kstack):
    engine = create_engine(kstack.database_url)
    yield engine
    engine.dispose()


@pytest.fixture(scope="module")
def plans():
    """Every job's kills, drawn once for the module: the victims each method allows, and the kinds dealt out so that
    each appears at least once (before-first-checkpoint only as a job's first kill)."""
    rng = random.Random(SEED)
    print(f"\nrandom kills: {replay()}")
    victims = {"sft": ["worker"], "dpo": ["worker"], "rft-sync": ["worker", "rollout"],
               "rft-async": ["worker", "rollout"], "sft-2-ranks": ["worker", "rank0", "rank1"]}
    # The jobs killed twice (the others once); not the group's, whose every attempt starts torchrun (~30 s).
    seconds = set(rng.sample(sorted(set(victims) - {"sft-2-ranks"}), EXTRA_KILLS))
    counts = {job: 1 + (job in seconds) for job in victims}
    kinds = list(KINDS) + [rng.choice(KINDS) for _ in range(sum(counts.values()) - len(KINDS))]
    while True:  # deal until before-first-checkpoint falls only on first kills
        rng.shuffle(kinds)
        dealt, i = {}, 0
        for job, n in counts.items():
            dealt[job] = kinds[i:i + n]
            i += n
        if all("before-first-checkpoint" not in k[1:] for k in dealt.values()):
            break
    # The draws of each kill's moment come from per-job RNGs, so one job's timing does not shift another's draws.
    out = {job: Plan([(kind, rng.choice(victims[job])) for kind in dealt[job]], random.Random(f"{SEED}-{job}"))
           for job in victims}
    yield out
    FIGURES["kill_random"] = {"seed": SEED, **{job: [str(k) for k in p.done] for job, p in out.items()}}


# -- the job's progress, read from the database -------------------------------------------------------------------
def job_row(db, job_id: str):
    with db.connect() as conn:
        return conn.execute(text("SELECT status, step, attempts FROM jobs WHERE id = :id"), {"id": job_id}).one()


def checkpoint_steps(db, job_id: str) -> tuple:
    with db.connect() as conn:
        return tuple(conn.execute(text("SELECT step FROM checkpoints WHERE job_id = :id ORDER BY step"),
                                  {"id": job_id}).scalars())


class Progress:
    """Polls one job's row; remembers when each attempt started (was first seen running) and each step's time."""

    def __init__(self, db, job_id: str, what: str):
        self.db, self.job_id, self.what = db, job_id, what
        self.attempt_started: dict[int, float] = {}
        self.steps_seen: list[tuple[int, float]] = []  # (step, when first seen) since the last rewind, in order
        self.row = None

    def poll(self):
        self.row = row = job_row(self.db, self.job_id)
        now = time.monotonic()
        if row.status == "running":
            self.attempt_started.setdefault(row.attempts, now)
            last = self.steps_seen[-1][0] if self.steps_seen else None
            if row.step != last:
                if last is not None and row.step < last:  # the attempt rewound to its checkpoint: start again
                    self.steps_seen.clear()
                self.steps_seen.append((row.step, now))
        return row

    def until(self, predicate, timeout_s: float = 240, what: str = ""):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            row = self.poll()
            assert row.status in ("queued", "running"), \
                f"{self.what}: the job ended ({row.status}) while waiting for {what} [{replay()}]"
            if predicate(row):
                return row
            time.sleep(POLL_S)
        raise AssertionError(f"{self.what}: timed out waiting for {what}; last {self.row} [{replay()}]")

    def step_time(self) -> float:
        """The last observed step duration: between the last two steps seen after the first (whose time includes
        the attempt's start-up), since the last rewind; 0.5 s before there are two."""
        seen = self.steps_seen[1:]
        if len(seen) < 2:
            return 0.5
        (s1, t1), (s2, t2) = seen[-2:]
        return (t2 - t1) / (s2 - s1)


# -- victims ------------------------------------------------------------------------------------------------------
def rollout_process(stack) -> psutil.Process | None:
    """The running RFT job's rollout process: the worker's spawned child (not multiprocessing's resource tracker)."""
    proc = stack.procs.get("worker")
    if proc is None:
        return None
    try:
        children = psutil.Process(proc.popen.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return None
    for child in children:
        try:  # a killed one not yet reaped (a zombie) or gone meanwhile is not the running job's
            if child.status() != psutil.STATUS_ZOMBIE and "spawn_main" in " ".join(child.cmdline()):
                return child
        except psutil.NoSuchProcess:
            continue
    return None


def rank_pid(stack, job_id: str, rank: int) -> int | None:
    """The live process of one rank of the job's running group (a pid file of an ended attempt names a dead one)."""
    for pid_file in stack.data_dir.rglob(f"{job_id}-*/group/rank{rank}.pid"):
        try:
            pid = int(pid_file.read_text())
            if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                return pid
        except (OSError, ValueError, psutil.NoSuchProcess):
            continue
    return None


def victim_ready(stack, job_id: str, victim: str) -> bool:
    if victim == "rollout":
        return rollout_process(stack) is not None
    if victim.startswith("rank"):
        return rank_pid(stack, job_id, int(victim[4:])) is not None
    return True


def send_kill(stack, job_id: str, victim: str) -> None:
    if victim == "worker":
        stack.kill("worker")  # SIGKILL to its process group: its rollout process or torchrun group go with it
        stack.start("worker")
    elif victim == "rollout":
        rollout_process(stack).kill()
    else:
        os.kill(rank_pid(stack, job_id, int(victim[4:])), signal.SIGKILL)


# -- one kill -----------------------------------------------------------------------------------------------------
def kill_once(stack, db, job, plan: Plan, kind: str, victim: str, n_steps: int, every: int) -> Kill:
    """Wait for the job's next attempt to run with its victim alive, then for the kind's point, and kill."""
    rng, progress = plan.rng, Progress(db, job.id, job.id)
    attempt = len(plan.done) + 1
    # A claimed attempt shows the lost one's step until it rewinds to the latest checkpoint: wait for that too.
    progress.until(lambda r: r.status == "running" and r.attempts == attempt
                   and r.step <= max(checkpoint_steps(db, job.id), default=0)
                   and victim_ready(stack, job.id, victim), what=f"attempt {attempt} with its {victim}")
    due = [s for s in range(every, n_steps, every)]  # checkpoint steps before the final one
    start_step = progress.row.step
    note = ""
    if kind == "before-first-checkpoint":
        target = rng.randint(0, every - 1)
        progress.until(lambda r: r.step >= target, what=f"step {target}")
        if target:
            time.sleep(rng.uniform(0, 0.9) * progress.step_time())
    elif kind == "mid-step":
        target = rng.randint(max(start_step, 1), n_steps - 2)
        progress.until(lambda r: r.step >= target, what=f"step {target}")
        time.sleep(rng.uniform(0.1, 0.9) * progress.step_time())
    elif kind in ("checkpoint-write", "after-checkpoint"):
        later = [c for c in due if c > max(start_step, max(checkpoint_steps(db, job.id), default=0))]
        if not later:  # resumed past the last checkpoint before the final one: the final one would end the job
            later, note = due[-1:], "resumed past the checkpoints; the next is the final one"
        target = later and rng.choice(later)
        if kind == "checkpoint-write":
            progress.until(lambda r: r.step >= target, what=f"step {target}")
            if target in checkpoint_steps(db, job.id):
                note = f"the checkpoint at step {target} was already written"
        else:
            progress.until(lambda r: target in checkpoint_steps(db, job.id), what=f"the checkpoint at {target}")
    else:  # uniform over the attempt's expected span, but before its last step (the kill must find it running)
        span = (n_steps - start_step) * max(progress.step_time(), 0.3) + 3.0
        deadline = time.monotonic() + rng.uniform(0, span)
        progress.until(lambda r: time.monotonic() >= deadline or r.step >= n_steps - 1, what="the drawn moment")
    row = progress.poll()
    assert row.status == "running" and row.attempts == attempt, \
        f"{job.id}: the attempt ended before the {kind} kill: {row} [{replay()}]"
    ckpts = checkpoint_steps(db, job.id)
    send_kill(stack, job.id, victim)
    if kind == "checkpoint-write" and not note and target in checkpoint_steps(db, job.id):
        note = f"the checkpoint at step {target} was stored as the signal went"
    started = progress.attempt_started.get(attempt, time.monotonic())
    return Kill(kind, victim, attempt, time.monotonic() - started, row.step, ckpts, note)


# -- what every job must end with ---------------------------------------------------------------------------------
def check_job(stack, db, client, job_id: str, plan: Plan, n_steps: int, every: int, samples_per_step: int = 0) -> None:
    kills = "; ".join(str(k) for k in plan.done)
    where = f"{job_id} killed {kills} [{replay()}]"
    done = client.wait_job(job_id, timeout_s=300)
    logs = [e.message for e in client.job_logs(job_id)]
    assert done.status == pb.JOB_STATUS_SUCCEEDED and done.step == n_steps, \
        f"{where}: {done.error}\n" + "\n".join(logs[-30:])
    assert done.attempts == len(plan.done) + 1, f"{where}: {done.attempts} attempts"
    steps = Counter(p.step for p in client.job_metrics(job_id))
    assert sorted(steps) == list(range(1, n_steps + 1)) and set(steps.values()) == {1}, \
        f"{where}: metric points per step {dict(sorted(steps.items()))}"
    ckpts = sorted(client.list_checkpoints(job_id), key=lambda c: (c.step, c.created_at.ToNanoseconds()))
    expected = sorted({*range(every, n_steps, every), n_steps})
    assert [c.step for c in ckpts] == expected, f"{where}: checkpoints at {[c.step for c in ckpts]}"
    assert [c.final for c in ckpts] == [False] * (len(expected) - 1) + [True], f"{where}: final flags"
    assert done.output_checkpoint_id == ckpts[-1].id, where
    blobs = BlobStore(stack.data_dir / "blobs")
    with db.connect() as conn:
        rows = {r.id: r for r in conn.execute(text("SELECT id, step, files, state FROM checkpoints WHERE job_id = :id"),
                                              {"id": job_id})}
    previous = 0
    for c in ckpts:
        row = rows[c.id]
        for f in [*row.files, *row.state]:  # every stored file is there and matches its sha256
            data = blobs.read_bytes(f["sha256"], f"checkpoint {c.id} {f['path']}")
            if samples_per_step and f["path"] == "rl_samples.jsonl":
                recorded = Counter(json.loads(line)["step"] for line in data.decode().splitlines() if line.strip())
                assert recorded == {s: samples_per_step for s in range(previous + 1, c.step + 1)}, \
                    f"{where}: samples per step in the checkpoint at {c.step}: {dict(sorted(recorded.items()))}"
        if samples_per_step:
            assert any(f["path"] == "rl_samples.jsonl" for f in row.state), f"{where}: no samples at step {c.step}"
        previous = c.step
    # The attempt after the last kill resumed from the newest checkpoint then, or from one stored after the signal
    # (a killed rollout process is noticed when the trainer next waits for it). An attempt killed before it read its
    # checkpoint logs nothing, so earlier kills are not counted here.
    resumed = [int(m.split("step ")[1].split()[0]) for m in logs if m.startswith("resuming from the checkpoint at")]
    if plan.done[-1].checkpoints:
        assert resumed and resumed[-1] >= max(plan.done[-1].checkpoints), f"{where}: resumed from {resumed}"
    print(f"{job_id}: killed {kills}; succeeded at step {n_steps} after {done.attempts} attempts, "
          f"{len(resumed)} resumed from a checkpoint")


def run_killed(stack, db, client, job, plan: Plan, n_steps: int, every: int, samples_per_step: int = 0) -> None:
    for kind, victim in plan.kills:
        plan.done.append(kill_once(stack, db, job, plan, kind, victim, n_steps, every))
    check_job(stack, db, client, job.id, plan, n_steps, every, samples_per_step)


# -- the jobs -----------------------------------------------------------------------------------------------------
def test_sft_lora_job(kstack, db, client, plans):
    ds, _ = client.upload_dataset(jsonl(chat_rows(16)), name="chat")
    job = client.create_sft_job(MODEL, ds.id, "sft", **SFT)
    run_killed(kstack, db, client, job, plans["sft"], SFT["max_steps"], SFT["checkpoint_every"])


def test_dpo_job(kstack, db, client, plans):
    rows = [preference_row(a, b) for a, b in PAIRS + [(b, a) for a, b in PAIRS]]
    ds, _ = client.upload_dataset(jsonl(rows), name="preferences")
    job = client.create_dpo_job(MODEL, ds.id, "dpo", **DPO)
    run_killed(kstack, db, client, job, plans["dpo"], DPO["max_steps"], DPO["checkpoint_every"])


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_rft_job(kstack, db, client, plans, mode):
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(10) for b in range(10)]
    ds, _ = client.upload_dataset(jsonl(rows), name=f"arithmetic-{mode}")
    job = client.create_rft_job(MODEL, ds.id, "builtin:digit_share", f"rft-{mode}", mode=mode, **RFT)
    run_killed(kstack, db, client, job, plans[f"rft-{mode}"], RFT["steps"], RFT["checkpoint_every"],
               samples_per_step=RFT["prompts_per_step"] * RFT["group_size"])


def test_sft_job_on_two_ranks(kstack, db, client, plans):
    """Last: the worker is restarted to train managed jobs on a torchrun group of 2 ranks."""
    kstack.stop("worker")
    kstack.extra_env.update({"TRAINYARD_MANAGED_NPROC": "2", "TRAINYARD_MANAGED_PARALLEL": '{"dp_shard": 2}'})
    kstack.start("worker")
    ds, _ = client.upload_dataset(jsonl(chat_rows(16)), name="chat-ranks")
    job = client.create_sft_job(MODEL, ds.id, "sft on two ranks", **GROUP)
    run_killed(kstack, db, client, job, plans["sft-2-ranks"], GROUP["max_steps"], GROUP["checkpoint_every"])
