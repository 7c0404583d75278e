"""WorkerSettings.rft_rollout: which rollout an RFT job samples from (docs/rft.md, "Where the policy is served")."""
from types import SimpleNamespace

import pydantic
import pytest

from services.common.ledger import HeldDevice
from services.trainer.rl.rollout import RolloutProcess
from services.worker.recipes.rft import rollout_backend, rollout_device
from services.worker.settings import WorkerSettings

URLS = dict(rollout_url="rollout:50053", weightsync_url="weightsync:50054")


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    for var in ("TRAINYARD_ROLLOUT_URL", "TRAINYARD_WEIGHTSYNC_URL", "TRAINYARD_RFT_ROLLOUT", "TRAINYARD_CONFIG"):
        monkeypatch.delenv(var, raising=False)


@pytest.mark.parametrize("settings, service", [
    ({}, False),  # the embedded quickstart: the defaults name no services
    (URLS, True),  # as docker-compose.yml configures the worker
    ({"rollout_url": "rollout:50053"}, False),
    ({**URLS, "rft_rollout": "process"}, False),
    ({"rft_rollout": "service"}, True),
])
def test_the_service_backend_is_used_where_both_services_are_configured(tmp_path, settings, service):
    assert WorkerSettings(data_dir=tmp_path, **settings).rft_rollout_service() is service


def test_the_environment_configures_it_as_compose_does(tmp_path, monkeypatch):
    monkeypatch.setenv("TRAINYARD_ROLLOUT_URL", "rollout:50053")
    monkeypatch.setenv("TRAINYARD_WEIGHTSYNC_URL", "weightsync:50054")
    assert WorkerSettings(data_dir=tmp_path).rft_rollout_service()
    with pytest.raises(pydantic.ValidationError, match="rft_rollout"):
        WorkerSettings(data_dir=tmp_path, rft_rollout="elsewhere")


@pytest.mark.parametrize("devices, device", [
    ([HeldDevice("g0", "gpu", 0, "trainer"), HeldDevice("g3", "gpu", 3, "rollout")], "cuda:3"),  # the booked split
    ([HeldDevice("c0", "cpu", 0, "trainer"), HeldDevice("c1", "cpu", 1, "rollout")], None),  # CPU slots
    ([HeldDevice("g0", "gpu", 0, "trainer")], None),  # no rollout device booked: the trainer's rule
])
def test_the_rollout_process_runs_on_the_jobs_rollout_device(tmp_path, devices, device):
    ctx = SimpleNamespace(settings=WorkerSettings(data_dir=tmp_path), devices=devices)
    backend = rollout_backend(ctx)
    assert backend.func is RolloutProcess and backend.keywords == {"device": device}
    assert rollout_device(devices) == device
