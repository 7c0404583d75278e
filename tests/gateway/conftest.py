"""Fixtures of the gateway tests: the real `tinker` SDK against the stack's gateway (docker-compose.yml's, started by
the `stack` fixture), and a second gateway in this process over the same services with small limits (long poll,
future lifetime, pending cap, chunk length) so those paths run in seconds."""
from __future__ import annotations

import os
import threading
import time

import pytest
import uvicorn

from services.gateway.app import build_app
from services.gateway.context import GatewayContext
from services.gateway.settings import GatewaySettings
from trainyard.localstack import free_port

os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture(scope="session")
def small_gateway(stack):
    """Base URL of a gateway with long_poll_s 0.5, future_ttl_s 4, 4 pending futures per account, chunks of 2 and
    bodies of at most 1 MiB."""
    settings = GatewaySettings(scheduler_url=stack.url("scheduler"), trainer_url=stack.url("trainer"),
                               rollout_url=stack.url("rollout"), host="127.0.0.1", gateway_port=free_port(),
                               long_poll_s=0.5, future_ttl_s=4, max_pending_futures_per_account=4,
                               fwdbwd_max_chunk_len=2, max_body_mb=1)
    server = uvicorn.Server(uvicorn.Config(build_app(GatewayContext(settings)), host="127.0.0.1",
                                           port=settings.gateway_port, log_config=None, ws="none"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{settings.gateway_port}"
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the in-process gateway did not start"
        time.sleep(0.05)
    yield url
    server.should_exit = True
    thread.join(10)


@pytest.fixture(scope="session")
def tinker_key(api_key) -> str:
    return f"tml-{api_key}"


@pytest.fixture(scope="session")
def other_tinker_key(other_api_key) -> str:
    return f"tml-{other_api_key}"


@pytest.fixture()
def tinker_service(stack, tinker_key):
    import tinker

    client = tinker.ServiceClient(base_url=stack.gateway_url(), api_key=tinker_key)
    yield client
    client.close("success").result()
