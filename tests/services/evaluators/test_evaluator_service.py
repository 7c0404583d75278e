"""EvaluatorService through the real scheduler server (its build function and settings) on Postgres, called with
the SDK and the CLI: upload, versions, ownership between accounts, per-row test results, clear field errors."""
from __future__ import annotations

import json

import grpc
import pytest
from click.testing import CliRunner

from tests.services.evaluators.scheduler_only import scheduler_only
from trainyard.cli.main import cli
from trainyard.client import Client
from trainyard.errors import TrainyardError, from_rpc_error
from trainyard.v1 import scheduler_pb2 as pb

REWARD = '''\
def reward_fn(completion, row):
    if completion == "boom":
        raise ValueError("cannot score " + repr(completion))
    if completion == "spin":
        while True:
            pass
    return 1.0 if completion.strip() == str(row["answer"]) else 0.0
'''


@pytest.fixture(scope="module")
def scheduler(tmp_path_factory, pg_url):
    with scheduler_only(tmp_path_factory.mktemp("scheduler"), pg_url, ("alice-evaluators", "bob-evaluators"),
                        evaluator_cpu_s=1, evaluator_wall_s=10, max_evaluator_test_rows=20) as (url, accounts):
        keys = {name.split("-")[0]: key for name, key in accounts.items()}
        clients = {name: Client(url=url, api_key=key) for name, key in keys.items()}
        yield url, keys, clients
        for c in clients.values():
            c.close()


def test_upload_list_get_and_test(scheduler, tmp_path):
    _, _, clients = scheduler
    alice = clients["alice"]
    source = tmp_path / "evaluator.py"
    source.write_text(REWARD)
    first = alice.upload_evaluator(source, name="exact")
    second = alice.upload_evaluator(source.read_bytes(), name="exact", filename="v2.py")
    assert (first.version, second.version, first.kind, first.filename) == (1, 2, "reward_fn", "evaluator.py")
    assert [e.version for e in alice.list_evaluators("exact")] == [2, 1]
    assert alice.get_evaluator("exact").id == second.id and alice.get_evaluator("exact@1").id == first.id

    resp = alice.test_evaluator("exact@1", rows=[{"answer": 4}] * 4, completions=["4", "5", "boom", "spin"])
    assert resp.evaluator.id == first.id
    got = [(r.row, r.ok, r.reward, r.error) for r in resp.results]
    assert got == [(1, True, 1.0, ""), (2, True, 0.0, ""), (3, False, 0.0, "ValueError: cannot score 'boom' (line 3)"),
                   (4, False, 0.0, "killed: CPU limit 1 s")]
    assert (resp.summary.num_rows, resp.summary.num_ok, resp.summary.num_errors) == (4, 2, 2)
    assert resp.summary.reward_mean == 0.5


def test_test_on_a_dataset(scheduler, tmp_path):
    _, _, clients = scheduler
    alice = clients["alice"]
    alice.upload_evaluator(REWARD.encode(), name="exact-ds")
    data = tmp_path / "sums.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+{i}=", "answer": 2 * i}) + "\n" for i in range(30)))
    ds, _ = alice.upload_dataset(data, name="sums")
    resp = alice.test_evaluator("exact-ds", dataset_id=ds.id, num_rows=3, completions=["0", "3"])
    assert [(r.completion, r.reward, r.ok) for r in resp.results] == [("0", 1.0, True), ("3", 0.0, True),
                                                                         ("", 0.0, True)]
    with pytest.raises(TrainyardError) as exc:
        alice.test_evaluator("exact-ds", dataset_id=ds.id, num_rows=21)
    assert exc.value.code == "INVALID_ARGUMENT" and [v.field for v in exc.value.violations] == ["num_rows"]


def test_another_account_sees_nothing(scheduler):
    _, _, clients = scheduler
    mine = clients["alice"].upload_evaluator(REWARD.encode(), name="private")
    bob = clients["bob"]
    for call in (lambda: bob.get_evaluator("private"), lambda: bob.get_evaluator(mine.id),
                 lambda: bob.test_evaluator(mine.id, rows=[{"answer": 1}], completions=["1"])):
        with pytest.raises(TrainyardError) as exc:
            call()
        assert exc.value.code == "NOT_FOUND"
    assert bob.list_evaluators() == []
    url = scheduler[0]
    with Client(url=url, api_key="ty_not-a-key") as stranger, pytest.raises(TrainyardError) as exc:
        stranger.list_evaluators()
    assert exc.value.code == "UNAUTHENTICATED"


@pytest.mark.parametrize("content, field, reason", [
    (b"def reward_fn(c, row)\n", "content", "evaluator.py line 1: SyntaxError"),
    (b"import numpy\n", "content", "No module named 'numpy'"),
    (b"x" * (1 << 20 | 1), "content", "more than the 1024 KB limit"),
])
def test_bad_uploads_are_invalid_argument_naming_the_field(scheduler, content, field, reason):
    _, _, clients = scheduler
    with pytest.raises(TrainyardError) as exc:
        clients["alice"].upload_evaluator(content, name="bad")
    assert exc.value.code == "INVALID_ARGUMENT" and [v.field for v in exc.value.violations] == [field]
    assert reason in exc.value.violations[0].reason, exc.value.violations


def test_bad_test_requests_name_the_field(scheduler):
    alice = scheduler[2]["alice"]
    alice.upload_evaluator(REWARD.encode(), name="exact-req")
    request = pb.EvaluatorTestRequest(evaluator="exact-req", rows=['{"answer": 1}', "[1]", "nope"])
    with pytest.raises(grpc.RpcError) as exc:  # the SDK always sends JSON objects: the raw stub, to send others
        alice.evaluators.TestEvaluator(request, **alice._kw())
    error = from_rpc_error(exc.value)
    assert error.code == "INVALID_ARGUMENT"
    assert [(v.row, v.field) for v in error.violations] == [(2, "rows"), (3, "rows")]
    row = [{"answer": 1}]
    for fields, field in ((dict(evaluator="exact-req", rows=row, dataset_id="ds_x"), "dataset_id"),
                          (dict(evaluator="exact-req"), "rows"),
                          (dict(evaluator="exact-req", rows=row, completions=["1", "2"]), "completions"),
                          (dict(evaluator="", rows=row), "evaluator")):
        with pytest.raises(TrainyardError) as exc:
            alice.test_evaluator(**fields)
        assert exc.value.code == "INVALID_ARGUMENT" and [v.field for v in exc.value.violations] == [field], exc.value


def test_the_cli(scheduler, tmp_path):
    url, keys, _ = scheduler
    env = {"TRAINYARD_URL": url, "TRAINYARD_API_KEY": keys["alice"]}
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "evaluator.py").write_text("from check import score\n\ndef reward_fn(c, row):\n    return score(c, row)\n")
    (package / "check.py").write_text("def score(c, row):\n    return float(c == row['answer'])\n")
    runner = CliRunner()
    up = runner.invoke(cli, ["evaluators", "upload", str(package), "--name", "cli-pkg"], env=env)
    assert up.exit_code == 0 and "cli-pkg@1 (reward_fn)" in up.output, up.output
    listed = runner.invoke(cli, ["evaluators", "list"], env=env)
    assert listed.exit_code == 0 and "cli-pkg" in listed.output, listed.output
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"answer": "yes", "completion": "yes"}\n{"answer": "yes", "completion": "no"}\n{"question": 1}\n')
    tested = runner.invoke(cli, ["evaluators", "test", "cli-pkg", "--rows-file", str(rows)], env=env)
    assert tested.exit_code == 0, tested.output
    assert "2/3 rows scored, 1 errors; reward mean 0.5" in tested.output, tested.output
    assert "KeyError: 'answer' (check.py line 2)" in tested.output, tested.output
    as_json = json.loads(runner.invoke(cli, ["evaluators", "test", "cli-pkg", "--rows-file", str(rows), "--json"],
                                       env=env).output)
    assert [r.get("ok", False) for r in as_json["results"]] == [True, True, False]
    assert as_json["results"][2]["error"] == "KeyError: 'answer' (check.py line 2)"
    bad = runner.invoke(cli, ["evaluators", "test", "cli-pkg"], env=env)
    assert bad.exit_code == 2 and "give exactly one of --dataset or --rows-file" in bad.output
