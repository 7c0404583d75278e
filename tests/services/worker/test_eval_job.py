"""Evaluation jobs: pass@k, the request's checks, the CLI's `jobs create --method eval`."""
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
from services.scheduler.datasets import DatasetStore, UploadHeader
from services.scheduler.jobs import JobCore, NewJob
from services.worker.recipes.evaluate import pass_at_k, summarize
from tests.services.common.inprocess import Platform

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
    assert problems(alice, {"evaluator": "e", "checkpoint_id": "ckpt_nope"}) == {"spec.eval.checkpoint_id"}
    job = platform.core.create(alice, NewJob("eval", "tiny", platform.rft, "", {"evaluator": "e",
                                                                               "checkpoint_id": ckpt.id}))
    assert (job.trainer_devices, job.rollout_devices) == (0, 1)  # an evaluation samples: one rollout device
    with pytest.raises(InvalidArgument, match="dataset .* is in sft_chat format; eval needs rft rows"):
        platform.core.create(alice, NewJob("eval", "tiny", _sft_dataset(platform), "", {"evaluator": "e"}))
    # Another account's checkpoint is not there for bob.
    bob_rft = DatasetStore(platform.db, BlobStore(platform.root / "blobs"), 1 << 20).upload(
        bob, UploadHeader("rft", "rft", ""), iter(RFT_ROWS))[0].id
    with pytest.raises(InvalidArgument) as err:
        platform.core.create(bob, NewJob("eval", "tiny", bob_rft, "", {"evaluator": "e", "checkpoint_id": ckpt.id}))
    assert [v.field for v in err.value.violations] == ["spec.eval.checkpoint_id"]
    with pytest.raises(InvalidArgument, match="PlanJob plans training jobs"):
        platform.core.planner = object()
        platform.core.plan(alice, NewJob("eval", "tiny", platform.rft, "", {"evaluator": "e"}))


def _sft_dataset(platform) -> str:
    row = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    return DatasetStore(platform.db, BlobStore(platform.root / "blobs"), 1 << 20).upload(
        platform.accounts["alice"], UploadHeader("chat", None, ""), iter([row] * 2))[0].id


def test_the_cli_creates_an_eval_job(platform):
    from trainyard.cli.main import cli

    out = CliRunner().invoke(cli, ["--url", platform.url("scheduler"), "--api-key", platform.keys["alice"], "jobs",
                                   "create", "--method", "eval", "--model", "tiny", "--dataset", platform.rft,
                                   "--evaluator", "exact@2", "--k", "3", "--temperature", "0.5", "--max-tokens", "16",
                                   "--pass-threshold", "0.5", "--max-rows", "2", "--sampling-seed", "7"])
    assert out.exit_code == 0, out.output
    job_id = out.output.split("job ")[1].split()[0]
    from trainyard import Client

    with Client(url=platform.url("scheduler"), api_key=platform.keys["alice"]) as c:
        job = c.get_job(job_id)
    e = job.spec.eval
    assert job.spec.WhichOneof("config") == "eval"
    assert (e.evaluator, e.checkpoint_id, e.samples_per_row, e.max_tokens, e.max_rows, e.seed) == \
        ("exact@2", "", 3, 16, 2, 7)
    assert (e.temperature, e.pass_threshold) == (0.5, 0.5)
    assert (job.spec.resources.trainer_devices, job.spec.resources.rollout_devices) == (0, 1)
    bad = CliRunner().invoke(cli, ["--url", platform.url("scheduler"), "--api-key", platform.keys["alice"], "jobs",
                                   "create", "--method", "eval", "--model", "tiny", "--dataset", platform.rft])
    assert bad.exit_code == 1 and "--evaluator (spec.eval.evaluator): required" in bad.output
