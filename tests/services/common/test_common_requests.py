"""What every request of every service is held to before its servicer runs (services/common/request_checks.py in the
interceptor of services/common/grpcserver.py), over the four real services in process: a NUL in any string field
and NaN or infinity in any float field is INVALID_ARGUMENT naming the field, and no stored row changes; bytes that
do not parse are INVALID_ARGUMENT too; an unexpected failure reaches the client as an error id, its detail only
the log; a revoked key's open streams end with UNAUTHENTICATED."""
from __future__ import annotations

import logging
import math
import re
import secrets
import threading
import time

import grpc
import pytest
from google.protobuf import message_factory
from google.protobuf.descriptor import FieldDescriptor
from grpc_status import rpc_status
from google.rpc import error_details_pb2

from inprocess import Platform
from tests.conftest import PG_ADMIN_URL, _admin as admin
from services.weightsync.client import publish_dir
from trainyard.v1 import (
    common_pb2,
    rollout_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    trainer_pb2,
    weightsync_pb2,
    weightsync_pb2_grpc,
)

STRING, MESSAGE = FieldDescriptor.TYPE_STRING, FieldDescriptor.TYPE_MESSAGE
FLOATS = (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE)
NUL = "a\x00b"
# Each service's file and the process serving it.
SERVICES = [(scheduler_pb2, "scheduler"), (trainer_pb2, "trainer"), (rollout_pb2, "rollout"),
            (weightsync_pb2, "weightsync")]


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def platform(request, tmp_path_factory, tiny_model_dir):
    """On SQLite, and on Postgres (a database of its own), which refuses what SQLite would store (a NUL)."""
    url = ""
    if request.param == "postgres":
        name = f"trainyard_requests_{secrets.token_hex(4)}"
        admin(f'CREATE DATABASE "{name}"')
        url = f"{PG_ADMIN_URL.rsplit('/', 1)[0].replace('postgresql://', 'postgresql+psycopg://')}/{name}"
    p = Platform(tmp_path_factory.mktemp("platform"), tiny_model_dir, database_url=url, auth_recheck_s=0.3)
    yield p
    p.close()
    if url:
        admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def poisonings(desc, depth: int = 0):
    """(plant, path, bad value) for every string and float field reachable in a message type: plant(msg) puts a NUL
    string or NaN there; path is how the server must name it."""
    for fd in desc.fields:
        if fd.type == MESSAGE and fd.message_type.GetOptions().map_entry:
            key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            if key_fd.type == STRING:
                yield (lambda m, fd=fd: _map_entry(m, fd, NUL)), f"{fd.name}[{NUL!r}]", "key"
            for plant, path, kind in _leaf_or_nested(value_fd, depth):
                yield (lambda m, fd=fd, plant=plant: plant(_map_entry(m, fd, "k"))), f"{fd.name}['k']{path}", kind
        elif fd.type == MESSAGE and depth < 4:
            for plant, path, kind in poisonings(fd.message_type, depth + 1):
                if fd.is_repeated:
                    yield (lambda m, fd=fd, plant=plant: plant(getattr(m, fd.name).add())), \
                        f"{fd.name}[0].{path}", kind
                else:
                    yield (lambda m, fd=fd, plant=plant: plant(getattr(m, fd.name))), f"{fd.name}.{path}", kind
        elif fd.type == STRING or fd.type in FLOATS:
            bad = NUL if fd.type == STRING else math.nan
            if fd.is_repeated:
                yield (lambda m, fd=fd, bad=bad: getattr(m, fd.name).append(bad)), f"{fd.name}[0]", fd.type
            else:
                yield (lambda m, fd=fd, bad=bad: setattr(m, fd.name, bad)), fd.name, fd.type


def _map_entry(msg, fd, key):
    """The map's value holder for key: the message value itself, or (msg, field, key) for a scalar map."""
    entries = getattr(msg, fd.name)
    if fd.message_type.fields_by_name["value"].type == MESSAGE:
        return entries[key]
    entries[key] = entries[key]
    return entries, key


def _leaf_or_nested(value_fd, depth):
    if value_fd.type == MESSAGE:
        for plant, path, kind in poisonings(value_fd.message_type, depth + 1):
            yield plant, "." + path, kind
    elif value_fd.type == STRING or value_fd.type in FLOATS:
        bad = NUL if value_fd.type == STRING else math.nan

        def plant(holder, bad=bad):
            entries, key = holder
            entries[key] = bad
        yield plant, "", value_fd.type


def _call(channel, method, request, metadata):
    """Send request (a one-message stream for client-streaming methods) and read the whole answer."""
    path = f"/{method.containing_service.full_name}/{method.name}"
    kw = dict(request_serializer=type(request).SerializeToString, response_deserializer=lambda b: b)
    if method.client_streaming and method.server_streaming:
        return list(channel.stream_stream(path, **kw)(iter([request]), metadata=metadata, timeout=30))
    if method.client_streaming:
        return channel.stream_unary(path, **kw)(iter([request]), metadata=metadata, timeout=30)
    if method.server_streaming:
        return list(channel.unary_stream(path, **kw)(request, metadata=metadata, timeout=30))
    return channel.unary_unary(path, **kw)(request, metadata=metadata, timeout=30)


def _violations(exc: grpc.RpcError) -> list[str]:
    status = rpc_status.from_call(exc)
    out = []
    for detail in status.details if status else []:
        bad = error_details_pb2.BadRequest()
        detail.Unpack(bad)
        out += [v.field for v in bad.field_violations]
    return out


def test_every_string_and_float_field_of_every_request_is_checked(platform):
    """One call per string or float field of every request message of every RPC of the four services, that field
    holding a NUL character or NaN: INVALID_ARGUMENT naming it, from every service, and no row changed."""
    before = platform.rows()
    calls = 0
    for module, name in SERVICES:
        channel = platform.channel(name)
        for service in module.DESCRIPTOR.services_by_name.values():
            for method in service.methods:
                request_cls = message_factory.GetMessageClass(method.input_type)
                for plant, path, _kind in poisonings(method.input_type):
                    request = request_cls()
                    plant(request)
                    with pytest.raises(grpc.RpcError) as exc:
                        _call(channel, method, request, platform.metadata("alice"))
                    where = f"{service.name}.{method.name} {path}"
                    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (where, exc.value.details())
                    assert _violations(exc.value) == [path], (where, exc.value.details())
                    calls += 1
    assert calls > 100, calls
    assert platform.rows() == before


def test_later_messages_of_a_client_stream_are_checked_too(platform):
    stub = weightsync_pb2_grpc.WeightSyncServiceStub(platform.channel("weightsync"))
    header = weightsync_pb2.PublishVersionRequest(header=weightsync_pb2.PublishVersionHeader(
        lineage="streamed", kind=weightsync_pb2.WEIGHT_KIND_LORA_ADAPTER,
        files=[weightsync_pb2.WeightFile(path="a.bin", sha256="0" * 64, size_bytes=1)]))
    chunk = weightsync_pb2.PublishVersionRequest(chunk=common_pb2.FileChunk(path="a\x00.bin", data=b"x"))
    with pytest.raises(grpc.RpcError) as exc:
        stub.PublishVersion(iter([header, chunk]), metadata=platform.metadata(), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _violations(exc.value) == ["messages[1].chunk.path"]


def test_bytes_that_do_not_parse_are_invalid_argument(platform):
    """A string field of invalid UTF-8 fails the protobuf parser: INVALID_ARGUMENT, not gRPC's INTERNAL."""
    get_job = platform.channel("scheduler").unary_unary(
        "/trainyard.v1.JobService/GetJob", request_serializer=lambda b: b, response_deserializer=lambda b: b)
    with pytest.raises(grpc.RpcError) as exc:
        get_job(b"\n\x02\xff\xfe", metadata=platform.metadata(), timeout=30)
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, exc.value.details()
    assert "not a valid request message" in exc.value.details()
    # The key is still checked first: a stranger learns nothing about the request.
    with pytest.raises(grpc.RpcError) as exc:
        get_job(b"\n\x02\xff\xfe", timeout=30)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_page_tokens_are_checked_before_the_database(platform):
    stub = scheduler_pb2_grpc.JobServiceStub(platform.channel("scheduler"))
    for token in ("9" * 30, "9" * 19, "+5", " 5", "5_0", "-1", "\u0663"):
        with pytest.raises(grpc.RpcError) as exc:
            stub.ListJobs(scheduler_pb2.ListJobsRequest(page={"page_token": token}), metadata=platform.metadata())
        assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (token, exc.value.details())
        assert _violations(exc.value) == ["page.page_token"]
    ok = stub.ListJobs(scheduler_pb2.ListJobsRequest(page={"page_token": "9" * 18}), metadata=platform.metadata())
    assert list(ok.jobs) == [] and ok.next_page_token == ""


def test_an_answer_that_echoes_a_huge_value_still_arrives(platform):
    """A status travels in trailing metadata (16 KiB by default): an error naming a 20000-character id the client
    sent is clipped, so the client gets NOT_FOUND / INVALID_ARGUMENT, not RESOURCE_EXHAUSTED "Stream removed"."""
    huge = "j" * 20000
    jobs = scheduler_pb2_grpc.JobServiceStub(platform.channel("scheduler"))
    with pytest.raises(grpc.RpcError) as exc:
        jobs.GetJob(scheduler_pb2.GetJobRequest(id=huge), metadata=platform.metadata())
    assert exc.value.code() == grpc.StatusCode.NOT_FOUND and "more characters" in exc.value.details()
    with pytest.raises(grpc.RpcError) as exc:
        jobs.CreateJob(scheduler_pb2.CreateJobRequest(spec={"base_model": huge, "dataset_id": huge,
                                                            "display_name": huge}), metadata=platform.metadata())
    assert exc.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND), exc.value.details()
    assert len(exc.value.details()) < 3000


def test_an_unexpected_error_reaches_the_client_as_an_error_id(platform, caplog):
    """A database error that is not the database being down (here a trigger refusing the row) is INTERNAL: the
    client gets an error id; the SQL goes to the log under that id, without the bound values (the key's hash)."""
    refuse = ["CREATE TRIGGER refuse_keys BEFORE INSERT ON api_keys BEGIN SELECT RAISE(ABORT, 'no more keys'); END"]
    if not platform.db.is_sqlite:
        refuse = ["CREATE FUNCTION refuse_keys() RETURNS trigger LANGUAGE plpgsql AS "
                  "$$ BEGIN RAISE EXCEPTION 'no more keys'; END $$",
                  "CREATE TRIGGER refuse_keys BEFORE INSERT ON api_keys FOR EACH ROW EXECUTE FUNCTION refuse_keys()"]
    with platform.db.engine.begin() as conn:
        for sql in refuse:
            conn.exec_driver_sql(sql)
    stub = scheduler_pb2_grpc.AccountServiceStub(platform.channel("scheduler"))
    try:
        with caplog.at_level(logging.ERROR, logger="trainyard.grpc"), pytest.raises(grpc.RpcError) as exc:
            stub.CreateApiKey(scheduler_pb2.CreateApiKeyRequest(name="ci"), metadata=platform.metadata())
    finally:
        with platform.db.engine.begin() as conn:
            conn.exec_driver_sql("DROP TRIGGER refuse_keys" + ("" if platform.db.is_sqlite else " ON api_keys"))
    assert exc.value.code() == grpc.StatusCode.INTERNAL
    details = exc.value.details()
    ref = re.search(r"error id ([0-9a-f]{16})", details).group(1)
    for leak in ("INSERT", "api_keys", "no more keys", "Traceback", "sqlite", "psycopg"):
        assert leak not in details, details
    logged = "\n".join(r.getMessage() + "\n" + (logging.Formatter().formatException(r.exc_info) if r.exc_info else "")
                       for r in caplog.records)
    assert ref in logged and "INSERT INTO api_keys" in logged and "no more keys" in logged
    assert "ty_" not in logged and not re.search(r"'[0-9a-f]{64}'", logged)  # no key, no key hash


def _next_with_deadline(stream, timeout_s: float):
    """The stream's next item, or the RpcError that ended it; pytest.fail when neither comes in time."""
    box: list = []

    def read():
        try:
            box.append(next(stream))
        except grpc.RpcError as exc:
            box.append(exc)

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout_s)
    if not box:
        stream.cancel()
        pytest.fail(f"the stream neither sent nor ended within {timeout_s}s")
    return box[0]


def test_a_revoked_keys_open_streams_end_unauthenticated(platform, tmp_path):
    """WatchLineage and WatchJob opened with a key, then the key revoked: both end with UNAUTHENTICATED within
    seconds (auth_recheck_s is 0.3 here), where they used to keep delivering."""
    key_id, key = platform.new_key("alice")
    md = (("authorization", f"Bearer {key}"),)
    weights = tmp_path / "v1"
    weights.mkdir()
    (weights / "adapter.bin").write_bytes(b"\1" * 64)
    sync = weightsync_pb2_grpc.WeightSyncServiceStub(platform.channel("weightsync"))
    publish_dir(sync, key, lineage="watched", parent_id="", kind=weightsync_pb2.WEIGHT_KIND_LORA_ADAPTER,
                base_model="tiny", directory=weights)
    scheduler = platform.channel("scheduler")
    datasets = scheduler_pb2_grpc.DatasetServiceStub(scheduler)
    row = b'{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
    upload = datasets.UploadDataset(iter([scheduler_pb2.UploadDatasetRequest(header={"name": "d"}),
                                          scheduler_pb2.UploadDatasetRequest(chunk=row * 8)]), metadata=md)
    jobs = scheduler_pb2_grpc.JobServiceStub(scheduler)
    job = jobs.CreateJob(scheduler_pb2.CreateJobRequest(spec=scheduler_pb2.JobSpec(
        method=scheduler_pb2.JOB_METHOD_SFT, base_model="tiny", dataset_id=upload.dataset.id,
        sft=scheduler_pb2.SftConfig())), metadata=md)  # queued: no worker runs here, so its watch never ends
    lineage_watch = sync.WatchLineage(weightsync_pb2.WatchLineageRequest(lineage="watched"), metadata=md)
    job_watch = jobs.WatchJob(scheduler_pb2.WatchJobRequest(id=job.id), metadata=md)
    assert _next_with_deadline(lineage_watch, 10).current.version == 1
    assert _next_with_deadline(job_watch, 10).job.id == job.id
    scheduler_pb2_grpc.AccountServiceStub(scheduler).RevokeApiKey(scheduler_pb2.RevokeApiKeyRequest(id=key_id),
                                                                  metadata=platform.metadata("alice"))
    revoked = time.monotonic()
    for stream in (lineage_watch, job_watch):
        end = _next_with_deadline(stream, 10)
        while not isinstance(end, grpc.RpcError):  # what was already on its way (the job's log lines)
            end = _next_with_deadline(stream, 10)
        assert end.code() == grpc.StatusCode.UNAUTHENTICATED, end
    assert time.monotonic() - revoked < 5
