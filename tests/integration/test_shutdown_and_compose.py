"""SIGTERM lets in-flight calls finish and leaves nothing half-written; the compose file is what the tests run."""
from __future__ import annotations

import threading
import time

import pytest

from tests.conftest import create_account
from trainyard.localstack import GRPC_SERVICES, Stack, compose_services
from tests.integration.data import chat_rows, jsonl
from trainyard import Client, TrainyardError

pytestmark = pytest.mark.integration


@pytest.fixture()
def lone_scheduler(tmp_path, pg_url, redis_url):
    s = Stack(tmp_path, database_url=pg_url, broker_url=redis_url,
              extra_env={"TRAINYARD_SHUTDOWN_GRACE_S": "30", "TRAINYARD_BUILTIN_TINY_MODELS": "false"})
    s.run_once("migrate")
    s.start("scheduler")
    s.wait_ready("scheduler")
    try:
        yield s
    finally:
        s.down()


def test_sigterm_lets_an_in_flight_upload_finish(lone_scheduler):
    key = create_account(lone_scheduler.env_for("scheduler"), "shutdown-tester")
    content = jsonl(chat_rows(40))
    chunks = [content[i:i + 200] for i in range(0, len(content), 200)]
    sent_half = threading.Event()

    def slow():
        for i, chunk in enumerate(chunks):
            if i == len(chunks) // 2:
                sent_half.set()
                time.sleep(3.0)  # SIGTERM arrives while the stream is half sent
            yield chunk

    class SlowSource:
        it = slow()

        def read(self, n):
            return next(self.it, b"")

    result = {}
    c = Client(url=lone_scheduler.url("scheduler"), api_key=key)
    t = threading.Thread(target=lambda: result.setdefault("ds", c.upload_dataset(SlowSource(), name="slow")))
    t.start()
    assert sent_half.wait(30)
    # The first half is handed to the transport, not yet necessarily read by the server: give it time to start the
    # call (a call the server has not started is refused at shutdown, rightly) while the stream stays half sent.
    time.sleep(0.7)
    proc = lone_scheduler.procs["scheduler"].popen
    proc.terminate()
    t.join(60)
    ds, dedup = result["ds"]
    assert ds.num_rows == 40 and not dedup
    assert proc.wait(60) == 0
    log = lone_scheduler.procs["scheduler"].log()
    assert "shutting down" in log and "stopped" in log
    # New calls are refused once the server is gone; the stored dataset is intact after a restart.
    with pytest.raises(TrainyardError) as exc:
        c.whoami()
    assert exc.value.code == "UNAVAILABLE"
    lone_scheduler.procs.pop("scheduler")
    lone_scheduler.start("scheduler")
    lone_scheduler.wait_ready("scheduler")
    c2 = Client(url=lone_scheduler.url("scheduler"), api_key=key)
    assert c2.preview_dataset(ds.id, 0, 100) == chat_rows(40)


@pytest.mark.parametrize("name", [n for n in GRPC_SERVICES if n != "scheduler"])
def test_services_exit_cleanly_on_sigterm(tmp_path, pg_url, redis_url, name):
    s = Stack(tmp_path, database_url=pg_url, broker_url=redis_url, extra_env={"TRAINYARD_TORCH_THREADS": "1"})
    s.run_once("migrate")
    s.start(name)
    try:
        s.wait_ready(name)
    finally:
        assert s.stop(name, timeout_s=60) == 0
    assert "stopped" in (s.log_dir / f"{name}.log").read_text()


def test_compose_file_defines_the_platform():
    services = compose_services()
    for name in ("postgres", "redis", "scheduler", "worker", "trainer", "rollout", "weightsync", "dashboard"):
        assert name in services, name
    app = services["scheduler"]["environment"]
    assert app["TRAINYARD_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert app["TRAINYARD_BROKER_URL"].startswith("redis://")
    assert services["worker"]["command"][:3] == ["celery", "-A", "services.worker.app"]


def test_compose_checks_health_and_starts_services_once_what_they_need_is_healthy():
    services = compose_services()
    apps = [n for n in services if n not in ("postgres", "redis", "migrate")]
    for name in apps:
        test = services[name]["healthcheck"]["test"]
        assert test[:4] == ["CMD", "python", "-m", "services.common.healthcheck"], (name, test)
    for name, svc in services.items():
        for needed, condition in (svc.get("depends_on") or {}).items():
            wanted = "service_completed_successfully" if needed == "migrate" else "service_healthy"
            assert condition == {"condition": wanted}, (name, needed, condition)
            assert "healthcheck" in services[needed] or needed == "migrate", (name, needed)
    for name in ("trainer", "rollout"):
        assert services[name]["depends_on"]["weightsync"] == {"condition": "service_healthy"}
    # Every service but the dashboard serves /metrics on 9100 in its container, published on its own host port.
    assert services["scheduler"]["environment"]["TRAINYARD_METRICS_PORT"] == "9100"
    for name in ("scheduler", "worker", "trainer", "rollout", "weightsync"):
        env = services[name]["environment"]
        assert env["TRAINYARD_METRICS_PORT"] == "9100" and any(str(p).endswith(":9100")
                                                               for p in services[name]["ports"]), name


def test_compose_healthchecks_pass_against_the_running_services(stack):
    for name in stack.procs:
        result = stack.healthcheck(name)
        assert result.returncode == 0, (name, result.stdout, result.stderr)
    assert stack.healthcheck("worker").args[-2] == stack.address("worker", 9100).split(":")[1]


def test_harness_runs_the_compose_commands(stack):
    """The running processes are exactly the compose commands, with only addresses and paths localized."""
    services = compose_services()
    for name, proc in stack.procs.items():
        declared = services[name]["command"]
        assert len(proc.argv) == len(declared)
        for ran, want in zip(proc.argv[1:], declared[1:]):
            assert ran == want or ran.isdigit(), (name, ran, want)
        for k in services[name].get("environment") or {}:
            assert k in proc.env, (name, k)


def test_compose_publishes_every_port_on_localhost_by_default():
    published = [(name, str(m)) for name, svc in compose_services().items() for m in svc.get("ports", [])]
    assert published and all(m.startswith("${TRAINYARD_PUBLISH_HOST:-127.0.0.1}:") and m.count(":") == 3
                             for _, m in published), published


def test_a_tls_service_is_started_and_checked_over_mutual_tls(tmp_path, pg_url, redis_url, pki):
    """The settings' TLS files in the environment: the service serves mutual TLS only, and the stack's readiness
    check (a client of it) connects with the same variables' CA and client certificate."""
    from services.common.channels import wait_healthy
    from trainyard.tls import channel_credentials

    tls = {"TRAINYARD_TLS_CERT_FILE": pki["server"], "TRAINYARD_TLS_KEY_FILE": pki["server.key"],
           "TRAINYARD_TLS_CLIENT_CA_FILE": pki["ca"], "TRAINYARD_TLS_CA_FILE": pki["ca"],
           "TRAINYARD_TLS_CLIENT_CERT_FILE": pki["client"], "TRAINYARD_TLS_CLIENT_KEY_FILE": pki["client.key"]}
    s = Stack(tmp_path, database_url=pg_url, broker_url=redis_url,
              extra_env={**{k: str(v) for k, v in tls.items()}, "TRAINYARD_TORCH_THREADS": "1"})
    s.run_once("migrate")
    s.start("weightsync")
    try:
        s.wait_ready("weightsync")
        for credentials in (None, channel_credentials(pki["ca"])):  # plaintext; TLS without a client certificate
            with pytest.raises(TimeoutError):
                wait_healthy(s.url("weightsync"), timeout_s=3, credentials=credentials)
        assert "(TLS)" in s.procs["weightsync"].log()
    finally:
        assert s.stop("weightsync", timeout_s=60) == 0
