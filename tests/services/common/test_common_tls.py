"""TLS from the settings (services/common/config.py, trainyard/tls.py): the four services in process serve TLS only,
the services reach each other over it, the SDK connects with a CA (and, under mutual TLS, a client certificate), and
a plaintext client or one without the right certificate is refused at the handshake; the OpenAI endpoint serves
HTTPS with the same certificate. Certificates come from the session's throwaway CA (the pki fixture)."""
from __future__ import annotations

import ssl

import grpc
import httpx
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from inprocess import Platform
from services.common.config import TrainyardSettings
from trainyard import Client, TrainyardError
from trainyard.localstack import free_port
from trainyard.tls import channel_credentials
from trainyard.v1 import trainer_pb2 as tpb, trainer_pb2_grpc, weightsync_pb2 as wpb, weightsync_pb2_grpc


def _serving(platform: Platform, service: str, credentials) -> bool:
    """Whether a health check over a channel with these credentials (None: plaintext) gets an answer."""
    ch = platform.channel(service, credentials)
    try:
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return health.status == health_pb2.HealthCheckResponse.SERVING
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
        return False


def _saved_over_tls(platform: Platform, credentials) -> None:
    """A Training API save: the trainer publishes to weight sync over the services' own TLS channel."""
    trainer = trainer_pb2_grpc.TrainerServiceStub(platform.channel("trainer", credentials))
    md = platform.metadata()
    sess = trainer.CreateSession(tpb.CreateSessionRequest(base_model="tiny", lora=tpb.SessionLora(rank=2)),
                                 metadata=md)
    tokens = torch.randint(3, 1000, (9,)).tolist()
    datum = tpb.Datum(tokens=tokens[:-1], loss_fn_inputs={"target_tokens": tpb.TensorData(
        dtype=tpb.TensorData.DTYPE_INT64, shape=[8], data=torch.tensor(tokens[1:]).numpy().astype("<i8").tobytes())})
    trainer.ForwardBackward(tpb.ForwardBackwardRequest(session_id=sess.id, data=[datum]), metadata=md)
    trainer.OptimStep(tpb.OptimStepRequest(session_id=sess.id), metadata=md)
    saved = trainer.SaveWeights(tpb.SaveWeightsRequest(session_id=sess.id), metadata=md)
    sync = weightsync_pb2_grpc.WeightSyncServiceStub(platform.channel("weightsync", credentials))
    assert sync.GetVersion(wpb.GetVersionRequest(id=saved.version_id), metadata=md).lineage == sess.id


def test_tls_refuses_plaintext_and_untrusted_clients(tmp_path, pki, tiny_model_dir):
    platform = Platform(tmp_path / "tls", tiny_model_dir, tls_cert_file=pki["server"],
                        tls_key_file=pki["server.key"], tls_ca_file=pki["ca"])
    try:
        trusted = channel_credentials(pki["ca"])
        for service in platform.servers:
            assert _serving(platform, service, trusted), service
            assert not _serving(platform, service, None), service  # plaintext
            assert not _serving(platform, service, channel_credentials(pki["rogue-ca"])), service
        _saved_over_tls(platform, trusted)
        urls = dict(url=platform.url("scheduler"), rollout_url=platform.url("rollout"),
                    api_key=platform.keys["alice"])
        with Client(**urls, tls_ca_file=str(pki["ca"])) as c:
            assert c.whoami().name == "alice"
        with Client(**urls, timeout_s=5) as c, pytest.raises(TrainyardError) as exc:
            c.whoami()
        assert exc.value.code == "UNAVAILABLE"
    finally:
        platform.close()


def test_mutual_tls_refuses_a_client_without_the_right_certificate(tmp_path, pki, tiny_model_dir):
    port = free_port()
    platform = Platform(tmp_path / "mtls", tiny_model_dir, tls_cert_file=pki["server"],
                        tls_key_file=pki["server.key"], tls_client_ca_file=pki["ca"], tls_ca_file=pki["ca"],
                        tls_client_cert_file=pki["server"], tls_client_key_file=pki["server.key"], openai_port=port)
    try:
        client = channel_credentials(pki["ca"], pki["client"], pki["client.key"])
        for service in platform.servers:
            assert _serving(platform, service, client), service
            assert not _serving(platform, service, channel_credentials(pki["ca"])), service  # no certificate
            assert not _serving(platform, service, channel_credentials(pki["ca"], pki["rogue-client"],
                                                                       pki["rogue-client.key"])), service
        _saved_over_tls(platform, client)
        urls = dict(url=platform.url("scheduler"), rollout_url=platform.url("rollout"),
                    api_key=platform.keys["alice"])
        with Client(**urls, tls_ca_file=str(pki["ca"]), tls_client_cert_file=str(pki["client"]),
                    tls_client_key_file=str(pki["client.key"])) as c:
            assert c.whoami().name == "alice"
        # The OpenAI endpoint: HTTPS with the same certificate, and the same client CA.
        verify = ssl.create_default_context(cafile=pki["ca"])
        url = f"https://127.0.0.1:{port}/health"
        verify.load_cert_chain(pki["client"], pki["client.key"])
        assert httpx.get(url, verify=verify, timeout=10).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(url, verify=ssl.create_default_context(cafile=pki["ca"]), timeout=10)  # no certificate
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)  # plaintext
    finally:
        platform.close()


def test_tls_settings_come_in_pairs(tmp_path, pki):
    with pytest.raises(ValueError, match="tls_cert_file and tls_key_file"):
        TrainyardSettings(data_dir=tmp_path, tls_cert_file=pki["server"])
    with pytest.raises(ValueError, match="tls_client_cert_file and tls_client_key_file"):
        TrainyardSettings(data_dir=tmp_path, tls_client_cert_file=pki["client"])
    with pytest.raises(ValueError, match="needs tls_cert_file"):
        TrainyardSettings(data_dir=tmp_path, tls_client_ca_file=pki["ca"])
    plain = TrainyardSettings(data_dir=tmp_path)
    assert plain.server_credentials() is None and plain.channel_credentials() is None
