"""Evaluation jobs: pass@k, the request's checks, the CLI's `jobs create --method eval`, and jobs end to end on the
tiny model (the base model and a trained checkpoint) with an evaluator uploaded through the API, scored in its
sandbox."""
from __future__ import annotations

import itertools
import json
import math
import threading

import pytest
from click.testing import CliRunner

from services.common.blobstore import BlobStore
from services.common.errors import InvalidArgument
from services.common.ledger import Ledger
from services.evaluators.store import EvaluatorStore
from services.scheduler.datasets import DatasetStore, UploadHeader
from services.scheduler.jobs import JobCore, NewJob
from services.worker.recipes.evaluate import pass_at_k, summarize
from tests.services.common.inprocess import Platform
from trainyard import Client
from trainyard.v1 import scheduler_pb2 as pb

EVALUATOR = b"""
def reward_fn(completion, row):
    if row.get("boom"):
        raise ValueError("no score for this row")
    if row["answer"] in completion:
        return 1.0
    return 0.5 if len(completion) % 2 else 0.0
"""


def reward(completion: str, row: dict) -> float | None:
    """The evaluator above, for checking its recorded scores."""
    if row.get("boom"):
        return None
    return 1.0 if row["answer"] in completion else (0.5 if len(completion) % 2 else 0.0)


RFT_ROWS = [json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}).encode() + b"\n" for a, b in
            [(1, 2), (3, 4), (5, 6), (7, 8)]]


@pytest.mark.parametrize("n,c,k", [(4, 0, 1), (4, 1, 1), (4, 1, 2), (5, 2, 3), (6, 5, 2), (3, 3, 3)])
def test_pass_at_k_is_the_chance_that_k_of_the_n_samples_hold_a_pass(n, c, k):
    subsets = list(itertools.combinations([True] * c + [False] * (n - c), k))
    assert pass_at_k(n, c, k) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    assert pass_at_k(n, c, 1) == pytest.approx(c / n)


def test_summary_leaves_failed_scores_out_of_the_mean_and_counts_them():
    results = [{"rewards": [1.0, 0.0, None], "errors": ["", "", "boom"], "passed": 1},
               {"rewards": [0.5, 0.5, 0.5], "errors": ["", "", ""], "passed": 0}]
    m = summarize(results, 3)
    assert m["eval/reward_mean"] == pytest.approx(2.5 / 5)
    assert m["eval/pass@1"] == pytest.approx((1 / 3 + 0) / 2)
    assert m["eval/pass@k"] == pytest.approx((1 + 0) / 2)
    assert (m["eval/errors"], m["eval/rows"], m["eval/k"]) == (1.0, 2.0, 3.0)
    assert math.isclose(summarize([], 2)["eval/reward_mean"], 0.0)


@pytest.fixture()
def platform(tmp_path, tiny_model_dir):
    p = Platform(tmp_path / "platform", tiny_model_dir)
    store = DatasetStore(p.db, BlobStore(tmp_path / "platform" / "blobs"), 1 << 20)
    p.rft = store.upload(p.accounts["alice"], UploadHeader("rft", "rft", ""), iter(RFT_ROWS))[0].id
    p.core = JobCore(p.db, Ledger(p.db), lambda job_id: None, 0.05, threading.Event())
    p.evaluator = EvaluatorStore(p.db, BlobStore(tmp_path / "platform" / "blobs")).upload(
        p.accounts["alice"], "sum-check", "evaluator.py", EVALUATOR)
    yield p
    p.close()


def test_eval_requests_are_checked_by_field(platform):
    alice, bob = platform.accounts["alice"], platform.accounts["bob"]
    sft = platform.core.create(alice, NewJob("sft", "tiny", _sft_dataset(platform), "", {"max_steps": 1}))
    ledger = Ledger(platform.db)
    ledger.claim(sft.id, "w")
    ckpt = ledger.add_checkpoint(sft.id, "w", step=1, files=[], state=[], final=True, metrics={})

    def problems(who: str, config: dict) -> set[str]:
        with pytest.raises(InvalidArgument) as err:
            platform.core.create(who, NewJob("eval", "tiny", platform.rft if who == alice else "", "", config))
        return {v.field for v in err.value.violations} if err.value.violations else {"?" + str(err.value)}

    assert problems(alice, {"samples_per_row": 0}) == {"spec.eval.evaluator", "spec.eval.samples_per_row"}
    assert problems(alice, {"evaluator": "nope"}) == {"spec.eval.evaluator"}
    assert problems(alice, {"evaluator": "sum-check@2"}) == {"spec.eval.evaluator"}
    assert problems(alice, {"evaluator": "sum-check", "checkpoint_id": "ckpt_nope"}) == {"spec.eval.checkpoint_id"}
    job = platform.core.create(alice, NewJob("eval", "tiny", platform.rft, "", {"evaluator": "sum-check@1",
                                                                               "checkpoint_id": ckpt.id}))
    assert (job.trainer_devices, job.rollout_devices) == (0, 1)  # an evaluation samples: one rollout device
    with pytest.raises(InvalidArgument, match="dataset .* is in sft_chat format; eval needs rft rows"):
        platform.core.create(alice, NewJob("eval", "tiny", _sft_dataset(platform), "", {"evaluator": "sum-check"}))
    # Another account's checkpoint and evaluator are not there for bob.
    bob_rft = DatasetStore(platform.db, BlobStore(platform.root / "blobs"), 1 << 20).upload(
        bob, UploadHeader("rft", "rft", ""), iter(RFT_ROWS))[0].id
    with pytest.raises(InvalidArgument) as err:
        platform.core.create(bob, NewJob("eval", "tiny", bob_rft, "", {"evaluator": "sum-check",
                                                                       "checkpoint_id": ckpt.id}))
    assert [v.field for v in err.value.violations] == ["spec.eval.evaluator", "spec.eval.checkpoint_id"]
    with pytest.raises(InvalidArgument, match="PlanJob plans training jobs"):
        platform.core.planner = object()
        platform.core.plan(alice, NewJob("eval", "tiny", platform.rft, "", {"evaluator": "sum-check"}))


def _sft_dataset(platform) -> str:
    row = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    return DatasetStore(platform.db, BlobStore(platform.root / "blobs"), 1 << 20).upload(
        platform.accounts["alice"], UploadHeader("chat", None, ""), iter([row] * 2))[0].id


def test_the_cli_creates_an_eval_job(platform):
    from trainyard.cli.main import cli

    out = CliRunner().invoke(cli, ["--url", platform.url("scheduler"), "--api-key", platform.keys["alice"], "jobs",
                                   "create", "--method", "eval", "--model", "tiny", "--dataset", platform.rft,
                                   "--evaluator", "sum-check@1", "--k", "3", "--temperature", "0.5", "--max-tokens", "16",
                                   "--pass-threshold", "0.5", "--max-rows", "2", "--sampling-seed", "7"])
    assert out.exit_code == 0, out.output
    job_id = out.output.split("job ")[1].split()[0]
    with Client(url=platform.url("scheduler"), api_key=platform.keys["alice"]) as c:
        job = c.get_job(job_id)
    e = job.spec.eval
    assert job.spec.WhichOneof("config") == "eval"
    assert (e.evaluator, e.checkpoint_id, e.samples_per_row, e.max_tokens, e.max_rows, e.seed) == \
        ("sum-check@1", "", 3, 16, 2, 7)
    assert (e.temperature, e.pass_threshold) == (0.5, 0.5)
    assert (job.spec.resources.trainer_devices, job.spec.resources.rollout_devices) == (0, 1)
    bad = CliRunner().invoke(cli, ["--url", platform.url("scheduler"), "--api-key", platform.keys["alice"], "jobs",
                                   "create", "--method", "eval", "--model", "tiny", "--dataset", platform.rft])
    assert bad.exit_code == 1 and "--evaluator (spec.eval.evaluator): required" in bad.output


def test_eval_jobs_score_the_base_model_and_a_checkpoint_and_keep_every_row(platform, tmp_path):
    from services.common.schema import Job
    from services.worker.job import run_managed_job
    from services.worker.settings import WorkerSettings

    settings = WorkerSettings(data_dir=platform.root, database_url=f"sqlite:///{platform.root / 'trainyard.db'}",
                              heartbeat_s=0.2, torch_threads=1, worker_host="eval-host", cpu_slots=2)
    rows = [*RFT_ROWS[:3], json.dumps({"prompt": "9+9=", "answer": "18", "boom": True}).encode() + b"\n"]
    alice = platform.accounts["alice"]
    ds = DatasetStore(platform.db, BlobStore(platform.root / "blobs"), 1 << 20).upload(
        alice, UploadHeader("eval", "rft", ""), iter(rows))[0].id
    sft = platform.core.create(alice, NewJob("sft", "tiny", _sft_dataset(platform), "",
                                             {"max_steps": 2, "learning_rate": 0.05, "eval_fraction": 0.0}))
    run_managed_job(sft.id, settings)
    with platform.db.session() as s:
        trained = s.get(Job, sft.id)
    assert trained.status == "succeeded", trained.error
    with Client(url=platform.url("scheduler"), api_key=platform.keys["alice"]) as c:
        outcomes = {}
        for checkpoint in ("", trained.output_checkpoint_id):
            job = c.create_job("eval", "tiny", ds, evaluator="sum-check", checkpoint_id=checkpoint,
                               samples_per_row=3, temperature=1.0, max_tokens=6, pass_threshold=1.0, sampling_seed=3)
            run_managed_job(job.id, settings)
            done = c.get_job(job.id)
            assert done.status == pb.JOB_STATUS_SUCCEEDED, done.error
            path = c.download_checkpoint(done.output_checkpoint_id, tmp_path / job.id) / "results.jsonl"
            results = [json.loads(line) for line in path.read_text().splitlines()]
            outcomes[checkpoint] = (done, results, [entry.message for entry in c.job_logs(job.id)])
        for checkpoint, (done, results, logs) in outcomes.items():
            assert any(m.startswith("row 3 completion 0: the evaluator failed: ValueError: no score for this row")
                       for m in logs), logs
            assert [r["row"] for r in results] == [0, 1, 2, 3]
            parsed = [json.loads(r) for r in rows]
            for r in results:
                assert len(r["completions"]) == 3 and len(r["rewards"]) == 3
                # Every recorded reward is what the uploaded evaluator gives that completion; failures keep the error.
                assert r["rewards"] == [reward(comp, parsed[r["row"]]) for comp in r["completions"]]
                assert all(("no score for this row" in e) == (v is None) for v, e in zip(r["rewards"], r["errors"]))
                assert r["passed"] == sum(v == 1.0 for v in r["rewards"])
            m = dict(done.latest_metrics)
            assert m == pytest.approx(summarize(results, 3))
            assert m["eval/errors"] == 3.0 and m["eval/rows"] == 4.0
            assert 0.0 <= m["eval/pass@1"] <= m["eval/pass@k"] <= 1.0
        base, tuned = outcomes[""][1], outcomes[trained.output_checkpoint_id][1]
        assert [r["completions"] for r in base] != [r["completions"] for r in tuned]  # the adapter was applied
        with pytest.raises(Exception, match="holds an evaluation's results"):
            c.create_deployment("results", job_id=outcomes[""][0].id)
