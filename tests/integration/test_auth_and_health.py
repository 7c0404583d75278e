"""Every RPC needs an API key; objects of another account are invisible; health and reflection are public."""
from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.integration.data import chat_rows, jsonl
from trainyard import Client, TrainyardError
from trainyard.v1 import (
    rollout_pb2,
    rollout_pb2_grpc,
    scheduler_pb2,
    scheduler_pb2_grpc,
    trainer_pb2,
    trainer_pb2_grpc,
    weightsync_pb2,
    weightsync_pb2_grpc,
)

pytestmark = pytest.mark.integration

SERVICES = {
    "scheduler": "trainyard.v1.JobService",
    "trainer": "trainyard.v1.TrainerService",
    "rollout": "trainyard.v1.RolloutService",
    "weightsync": "trainyard.v1.WeightSyncService",
}


@pytest.mark.parametrize("name", list(SERVICES))
def test_health_and_reflection_are_public(stack, name):
    with grpc.insecure_channel(stack.url(name)) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        assert health.Check(health_pb2.HealthCheckRequest(service="")).status == health_pb2.HealthCheckResponse.SERVING
        assert health.Check(health_pb2.HealthCheckRequest(service=SERVICES[name])).status == \
            health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        resp = next(refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")])))
        listed = {s.name for s in resp.list_services_response.service}
        assert SERVICES[name] in listed and "grpc.health.v1.Health" in listed


def _calls(stack):
    """One cheap call per service, made with the given metadata."""
    return {
        "scheduler": lambda ch, md: scheduler_pb2_grpc.DatasetServiceStub(ch).ListDatasets(
            scheduler_pb2.ListDatasetsRequest(), metadata=md, timeout=10),
        "trainer": lambda ch, md: trainer_pb2_grpc.TrainerServiceStub(ch).GetSession(
            trainer_pb2.GetSessionRequest(id="sess_x"), metadata=md, timeout=10),
        "rollout": lambda ch, md: rollout_pb2_grpc.RolloutServiceStub(ch).ListLoaded(
            rollout_pb2.ListLoadedRequest(), metadata=md, timeout=10),
        "weightsync": lambda ch, md: weightsync_pb2_grpc.WeightSyncServiceStub(ch).ListVersions(
            weightsync_pb2.ListVersionsRequest(), metadata=md, timeout=10),
    }


@pytest.mark.parametrize("name", list(SERVICES))
@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer ty_wrong"),), (("x-api-key", "nope"),)],
                         ids=["missing", "wrong-bearer", "wrong-header"])
def test_every_service_rejects_missing_or_wrong_key(stack, name, metadata):
    with grpc.insecure_channel(stack.url(name)) as ch, pytest.raises(grpc.RpcError) as exc:
        _calls(stack)[name](ch, metadata)
    assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_cli_style_client_reports_unauthenticated(stack):
    with Client(url=stack.url("scheduler"), api_key="ty_not_a_key") as c, pytest.raises(TrainyardError) as exc:
        c.whoami()
    assert exc.value.code == "UNAUTHENTICATED"


def test_key_lifecycle_and_revocation(stack, client):
    me = client.whoami()
    assert me.name == "alice"
    created = client.create_api_key("ci")
    with Client(url=stack.url("scheduler"), api_key=created.secret) as second:
        assert second.whoami().id == me.id
        with pytest.raises(TrainyardError) as exc:
            second.revoke_api_key(created.key.id)  # a key cannot revoke itself
        assert exc.value.code == "FAILED_PRECONDITION"
        client.revoke_api_key(created.key.id)
        with pytest.raises(TrainyardError) as exc:
            second.whoami()
        assert exc.value.code == "UNAUTHENTICATED"
    assert any(k.id == created.key.id and k.revoked_at.seconds for k in client.list_api_keys())


def test_other_accounts_objects_are_not_found(client, other_client):
    ds, _ = client.upload_dataset(jsonl(chat_rows(4)), name="private")
    for call in (lambda: other_client.get_dataset(ds.id), lambda: other_client.preview_dataset(ds.id),
                 lambda: other_client.delete_dataset(ds.id),
                 lambda: other_client.create_sft_job("tiny-qwen3", ds.id)):
        with pytest.raises(TrainyardError) as exc:
            call()
        assert exc.value.code == "NOT_FOUND", exc.value
    assert ds.id not in {d.id for d in other_client.list_datasets()}
    # The owner still sees it, unchanged.
    assert client.get_dataset(ds.id).num_rows == 4
