"""Observability of every service (services/common/metrics.py, logs.py, healthcheck.py): the interceptor counts and
times each call by method and code and logs it with the call's ids; /metrics serves them; JSON log records carry
the request, account, job and session ids; the scheduler's job gauges; the container healthcheck."""
from __future__ import annotations

import io
import json
import logging
import urllib.request

import grpc
import pytest
from prometheus_client import REGISTRY

from services.common import logs
from services.common.auth import create_account
from services.common.channels import auth_metadata
from services.common.db import Database, migrate
from services.common.healthcheck import main as healthcheck
from services.common.ledger import Ledger
from services.common.schema import Dataset, Job, utcnow
from services.scheduler.app import job_gauges
from services.trainer.app import TrainerSettings, build as build_trainer
from services.weightsync.app import WeightSyncSettings, build as build_weightsync
from trainyard.localstack import free_port
from trainyard.v1 import trainer_pb2 as tpb, trainer_pb2_grpc, weightsync_pb2 as wpb, weightsync_pb2_grpc


def _count(service: str, method: str, code: str) -> float:
    return REGISTRY.get_sample_value("trainyard_grpc_requests_total",
                                     {"service": service, "method": method, "code": code}) or 0.0


@pytest.fixture
def captured():
    """JSON records of the trainyard loggers, as a service writes them with log_format json."""
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(logs.JsonFormatter())
    root = logging.getLogger("trainyard")
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.DEBUG)
    yield lambda: [json.loads(line) for line in stream.getvalue().splitlines()]
    root.removeHandler(handler)
    root.setLevel(old_level)


@pytest.fixture
def servers(tmp_path):
    url = f"sqlite:///{tmp_path / 'trainyard.db'}"
    migrate(url)
    db = Database(url)
    account, _, key = create_account(db, "alice")
    common = dict(data_dir=tmp_path, database_url=url, host="127.0.0.1", grpc_workers=4, shutdown_grace_s=0)
    weightsync = build_weightsync(WeightSyncSettings(weightsync_port=0, metrics_port=free_port(), **common))
    trainer = build_trainer(TrainerSettings(trainer_port=0, weightsync_url=f"127.0.0.1:{free_port()}", **common))
    for server in (weightsync, trainer):
        server.start()
    yield {"weightsync": weightsync, "trainer": trainer, "account": account.id, "key": key}
    for server in (weightsync, trainer):
        server.stop()
    db.dispose()


def test_every_call_is_counted_by_method_and_code_and_served_on_metrics(servers):
    service = "trainyard.v1.WeightSyncService"
    before = {code: _count(service, m, code) for m, code in (("ListVersions", "OK"), ("GetVersion", "NOT_FOUND"),
                                                             ("GetVersion", "UNAUTHENTICATED"))}
    with grpc.insecure_channel(f"127.0.0.1:{servers['weightsync'].port}") as channel:
        stub = weightsync_pb2_grpc.WeightSyncServiceStub(channel)
        md = auth_metadata(servers["key"])
        stub.ListVersions(wpb.ListVersionsRequest(lineage="x"), metadata=md)
        for metadata, code in ((md, grpc.StatusCode.NOT_FOUND), (auth_metadata("ty_wrong"),
                                                                 grpc.StatusCode.UNAUTHENTICATED)):
            with pytest.raises(grpc.RpcError) as exc:
                stub.GetVersion(wpb.GetVersionRequest(id="wv_missing"), metadata=metadata)
            assert exc.value.code() == code
    assert _count(service, "ListVersions", "OK") == before["OK"] + 1
    assert _count(service, "GetVersion", "NOT_FOUND") == before["NOT_FOUND"] + 1
    assert _count(service, "GetVersion", "UNAUTHENTICATED") == before["UNAUTHENTICATED"] + 1
    latency = REGISTRY.get_sample_value("trainyard_grpc_request_duration_seconds_count",
                                        {"service": service, "method": "ListVersions", "code": "OK"})
    assert latency >= 1
    port = servers["weightsync"].metrics_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    assert f'trainyard_grpc_requests_total{{code="NOT_FOUND",method="GetVersion",service="{service}"}}' in text
    assert healthcheck(["http", str(port), "/metrics"]) == 0


def test_json_log_records_carry_the_calls_ids(servers, captured):
    with grpc.insecure_channel(f"127.0.0.1:{servers['trainer'].port}") as channel:
        stub = trainer_pb2_grpc.TrainerServiceStub(channel)
        md = (*auth_metadata(servers["key"]), ("x-request-id", "req-42"))
        with pytest.raises(grpc.RpcError):
            stub.OptimStep(tpb.OptimStepRequest(session_id="sess_nope", seq_id=1), metadata=md)
        with pytest.raises(grpc.RpcError):
            stub.GetSession(tpb.GetSessionRequest(id="sess_other"), metadata=auth_metadata(servers["key"]))
    records = [r for r in captured() if r["logger"] == "trainyard.rpc"]
    optim = next(r for r in records if "OptimStep" in r["message"])
    assert optim["level"] == "INFO" and "NOT_FOUND" in optim["message"]
    assert (optim["request_id"], optim["account_id"], optim["session_id"]) == ("req-42", servers["account"],
                                                                            "sess_nope")
    get = next(r for r in records if "GetSession" in r["message"])
    assert get["session_id"] == "sess_other" and len(get["request_id"]) == 16 and get["request_id"] != "req-42"


def test_log_scopes_and_both_formats():
    record = logging.LogRecord("trainyard.worker", logging.WARNING, __file__, 1, "job %s slow", ("j1",), None)
    with logs.scope(job_id="job_1", account_id="acct_1"):
        logs.annotate(session_id="sess_1", request_id="")
        as_json = json.loads(logs.JsonFormatter().format(record))
        as_text = logs.TextFormatter().format(record)
    assert {k: as_json[k] for k in ("message", "job_id", "account_id", "session_id")} == {
        "message": "job j1 slow", "job_id": "job_1", "account_id": "acct_1", "session_id": "sess_1"}
    assert "request_id" not in as_json
    assert as_text.endswith("job j1 slow [account_id=acct_1 job_id=job_1 session_id=sess_1]")
    assert logs.current_ids() == {}
    logs.annotate(job_id="outside")  # outside any scope: nothing to add to
    assert logs.current_ids() == {}


def test_job_gauges_count_jobs_by_status(tmp_path):
    url = f"sqlite:///{tmp_path / 'jobs.db'}"
    migrate(url)
    db = Database(url)
    account = create_account(db, "alice")[0].id
    with db.session() as s:
        s.add(Dataset(id="ds_1", account_id=account, name="d", format="chat", num_rows=1, size_bytes=1,
                      sha256="0" * 64))
        for i, status in enumerate(["queued", "queued", "running", "succeeded"]):
            s.add(Job(id=f"job_{i}", account_id=account, method="sft", base_model="tiny", model_path="/m",
                      dataset_id="ds_1", status=status, created_at=utcnow()))
    gauges = job_gauges(Ledger(db))
    families = {f.name: {tuple(s.labels.values()): s.value for s in f.samples} for f in gauges.collect()}
    assert families["trainyard_jobs"] == {("queued",): 2, ("running",): 1, ("succeeded",): 1, ("failed",): 0,
                                          ("cancelled",): 0}
    assert families["trainyard_job_queue_depth"] == {(): 2}
    db.dispose()
    down = job_gauges(Ledger(Database("postgresql+psycopg://nobody@127.0.0.1:1/none")))
    assert [f.samples for f in down.collect()] == [[], []]  # the scrape goes on without them


def test_the_healthcheck_answers_for_a_serving_server_only(servers):
    assert healthcheck(["grpc", str(servers["trainer"].port)]) == 0
    assert healthcheck(["grpc", str(free_port()), "--timeout", "0.5"]) == 1
    assert healthcheck(["http", str(free_port()), "/metrics", "--timeout", "0.5"]) == 1


def test_the_rollout_counts_engine_tokens_and_reports_its_kv_pools(tiny_model_dir, one_thread):
    from services.rollout.app import kv_gauges
    from services.rollout.engine import Engine
    from services.rollout.sampling import SamplingParams

    def tokens(kind: str) -> float:
        return REGISTRY.get_sample_value("trainyard_engine_tokens_total", {"kind": kind}) or 0.0

    engine = Engine(kv_cache_mb=4)
    try:
        before = tokens("prompt"), tokens("generated")
        (seq,) = engine.generate(str(tiny_model_dir), None, [5, 6, 7, 8],
                                 SamplingParams(temperature=0, max_tokens=6))
        assert (tokens("prompt") - before[0], tokens("generated") - before[1]) == (4, len(seq.tokens)) != (4, 0)
        (family,) = kv_gauges(engine).collect()
        values = {tuple(s.labels.values()): s.value for s in family.samples}
        total = values[(str(tiny_model_dir), "total")]
        assert total > 0 and values[(str(tiny_model_dir), "used")] == 0  # the finished request gave its blocks back
    finally:
        engine.close()
