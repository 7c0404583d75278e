"""What the dashboard's AppTest modules share: an account of the module's own (its ACCOUNT), an SDK client on it,
and the environment the sidebar is prefilled from (docker-compose sets the URLs; a user could set the key)."""
from __future__ import annotations

import pytest

from tests.conftest import create_account


@pytest.fixture(scope="module")
def key(request, stack) -> str:
    return create_account(stack.env_for("scheduler"), request.module.ACCOUNT)


@pytest.fixture(scope="module")
def sdk(stack, key):
    from trainyard import Client

    with Client(url=stack.url("scheduler"), rollout_url=stack.url("rollout"), api_key=key) as c:
        yield c


@pytest.fixture()
def signed_in_env(monkeypatch, stack, key):
    monkeypatch.setenv("TRAINYARD_URL", stack.url("scheduler"))
    monkeypatch.setenv("TRAINYARD_ROLLOUT_URL", stack.url("rollout"))
    monkeypatch.setenv("TRAINYARD_API_KEY", key)
