"""Client channels between services (and from the SDK): one place for message limits and auth metadata."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def _options(max_message_mb: int) -> list[tuple[str, int]]:
    size = max_message_mb * 1024 * 1024
    return [("grpc.max_receive_message_length", size), ("grpc.max_send_message_length", size),
            ("grpc.enable_http_proxy", 0), ("grpc.use_local_subchannel_pool", 1),
            ("grpc.initial_reconnect_backoff_ms", 200), ("grpc.max_reconnect_backoff_ms", 2000)]


def open_channel(target: str, max_message_mb: int = 64,
                 credentials: grpc.ChannelCredentials | None = None) -> grpc.Channel:
    """A channel between services: TLS with credentials (TrainyardSettings.channel_credentials()), else plain TCP.
    Reconnect backoff is capped at 2 s (gRPC's default grows to 2 minutes), so a restarted peer is reached again
    within seconds."""
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=_options(max_message_mb))
    return grpc.insecure_channel(target, options=_options(max_message_mb))


def open_aio_channel(target: str, max_message_mb: int = 64,
                     credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """open_channel's asyncio twin, for many long streams served by one event loop (call it on that loop)."""
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=_options(max_message_mb))
    return grpc.aio.insecure_channel(target, options=_options(max_message_mb))


def ready(channel: grpc.Channel, timeout_s: float) -> bool:
    """Whether the channel connects within timeout_s (it tries at once, past any reconnect backoff)."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return True
    except grpc.FutureTimeoutError:
        return False


def auth_metadata(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),)


def wait_healthy(target: str, timeout_s: float = 30.0, service: str = "",
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    """Block until the server at target reports SERVING (raises TimeoutError)."""
    import time

    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    with open_channel(target, credentials=credentials) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while time.monotonic() < deadline:
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError as exc:
                last = exc
            time.sleep(0.2)
    raise TimeoutError(f"{target} did not become healthy within {timeout_s:.0f}s ({last})")
