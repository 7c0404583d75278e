"""Run the platform's services as local processes, straight from docker-compose.yml.

Used where no container engine runs: by `trainyard demo` (embedded SQLite and filesystem broker) and by the
integration tests (the real Postgres and Redis). Each compose service's own `command` runs with its own
`environment`, changing only what must differ outside containers: host names become 127.0.0.1 with free ports, the
database and broker URLs point where the caller says (None = the embedded default), and the data volume is a local
directory. Entry points, flags and variables all come from the file, so it cannot drift from what runs.
"""
from __future__ import annotations

import ctypes.util
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
COMPOSE = ROOT / "docker-compose.yml"
GRPC_SERVICES = ("scheduler", "trainer", "rollout", "weightsync")
INFRA = ("postgres", "redis")


def preloadable(libraries: str) -> bool:
    """Whether every library of an LD_PRELOAD value is installed (a bare name is looked up as the loader would)."""
    names = [n for n in re.split(r"[:\s]+", libraries) if n]
    return all(Path(n).is_file() if "/" in n else ctypes.util.find_library(_stem(n)) is not None for n in names)


def _stem(name: str) -> str:
    """'libjemalloc.so.2' -> 'jemalloc', as ctypes.util.find_library takes it."""
    return name.removeprefix("lib").split(".so")[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def published_port(mapping: str) -> int:
    """The host port of a compose port mapping ("${TRAINYARD_PUBLISH_HOST:-127.0.0.1}:50051:50051" -> 50051)."""
    return int(str(mapping).split(":")[-2])


def compose_services() -> dict[str, dict]:
    if not COMPOSE.is_file():
        raise FileNotFoundError(f"{COMPOSE} not found: run from a checkout of the Trainyard repository")
    return yaml.safe_load(COMPOSE.read_text())["services"]


@dataclass
class Proc:
    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    popen: subprocess.Popen | None = None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


@dataclass
class Stack:
    work_dir: Path
    database_url: str | None  # None: the embedded SQLite default under the data directory
    broker_url: str | None    # None: the embedded filesystem broker
    extra_env: dict[str, str] = field(default_factory=dict)
    # "<service>:<container port>" -> local port. Given ones are kept (a stack started earlier, trainyard/up.py);
    # the others are free ports: the compose file's published port where it is free and published_ports is set
    # (stable addresses for people), else any free port (tests, the demo).
    ports: dict[str, int] = field(default_factory=dict)
    procs: dict[str, Proc] = field(default_factory=dict)
    published_ports: bool = False

    def __post_init__(self) -> None:
        self.services = compose_services()
        self.log_dir = self.work_dir / "logs"
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Container paths of volumes and bind mounts -> local directories under work_dir.
        self.volumes: dict[str, Path] = {}
        for name, svc in self.services.items():
            for mapping in svc.get("ports", []):
                key = f"{name}:{str(mapping).split(':')[-1]}"
                if key not in self.ports:
                    wanted = published_port(mapping)
                    taken = set(self.ports.values())
                    self.ports[key] = (wanted if self.published_ports and wanted not in taken and port_free(wanted)
                                       else free_port())
            if name in INFRA:
                continue
            for volume in svc.get("volumes", []):
                source, target = str(volume).split(":")[:2]
                self.volumes[target] = self.work_dir / "volumes" / Path(source).name
        for path in self.volumes.values():
            path.mkdir(parents=True, exist_ok=True)
        self.data_dir = self.volumes["/data"]
        self.models_dir = self.volumes["/models"]
        self.queue = f"trainyard-{os.getpid()}-{time.monotonic_ns()}"

    # -- translation of compose service -> local process ---------------------------------------------------------
    def _local(self, value: str) -> str:
        """Rewrite '<service>:<container port>' to the local address of that service, and container paths of
        volumes to their local directories."""
        def sub(m: re.Match) -> str:
            key = f"{m.group(1)}:{m.group(2)}"
            return f"127.0.0.1:{self.ports[key]}" if key in self.ports else m.group(0)
        value = re.sub(r"\b([a-z][a-z0-9_-]*):(\d+)\b", sub, value)
        for target, local in self.volumes.items():
            value = re.sub(rf"(?<![\w/.]){re.escape(target)}(?=$|[/\"'\],])", str(local), value)
        return value

    def env_for(self, name: str) -> dict[str, str]:
        svc = self.services[name]
        env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR", "VIRTUAL_ENV") if k in os.environ}
        env["PYTHONPATH"] = str(ROOT)
        for k, v in (svc.get("environment") or {}).items():
            env[k] = self._local(str(v))
        for var, value in (("TRAINYARD_DATABASE_URL", self.database_url), ("TRAINYARD_BROKER_URL", self.broker_url)):
            if var in env:
                if value is None:
                    del env[var]
                else:
                    env[var] = value
        if "TRAINYARD_DATA_DIR" in env:
            env["TRAINYARD_CELERY_QUEUE"] = self.queue  # jobs of this stack only, whatever else shares the broker
        env["TRAINYARD_HOST"] = "127.0.0.1"
        for svc_name in GRPC_SERVICES:
            key = f"{svc_name}:{self._container_port(svc_name)}"
            if key in self.ports:
                env[f"TRAINYARD_{svc_name.upper()}_PORT"] = str(self.ports[key])
        for k, v in list(env.items()):  # a published port the service reads from its environment (OPENAI_PORT)
            if k.endswith("_PORT") and f"{name}:{v}" in self.ports:
                env[k] = str(self.ports[f"{name}:{v}"])
        env.update(self.extra_env)
        if "LD_PRELOAD" in env and not preloadable(env["LD_PRELOAD"]):
            del env["LD_PRELOAD"]  # e.g. jemalloc where it is not installed: the default allocator serves
        return env

    def _container_port(self, name: str) -> str:
        ports = self.services[name].get("ports", [])
        return str(ports[0]).split(":")[-1] if ports else ""

    def argv_for(self, name: str) -> list[str]:
        cmd = list(self.services[name]["command"])
        bindir = Path(sys.executable).parent
        if cmd[0] == "python":
            cmd[0] = sys.executable
        elif (bindir / cmd[0]).exists():
            cmd[0] = str(bindir / cmd[0])
        port = self._container_port(name)
        if port:  # a port passed on the command line (e.g. streamlit's --server.port)
            cmd = [str(self.ports[f"{name}:{port}"]) if a == port else a for a in cmd]
        return cmd

    # -- lifecycle ---------------------------------------------------------------------------------------------
    def url(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[f'{name}:{self._container_port(name)}']}"

    def gateway_url(self) -> str:
        """The base URL the tinker SDK takes (ServiceClient(base_url=...)) for this stack's gateway."""
        return f"http://{self.url('gateway')}"

    def address(self, name: str, container_port: int | str) -> str:
        """The local address of another port a service publishes (e.g. its metrics port, 9100)."""
        return f"127.0.0.1:{self.ports[f'{name}:{container_port}']}"

    def healthcheck(self, name: str, timeout_s: float = 30) -> subprocess.CompletedProcess:
        """Run the service's compose healthcheck against its local process (its command, ports localized)."""
        test = list(self.services[name]["healthcheck"]["test"])
        if test[0] != "CMD":
            raise ValueError(f"{name}: only exec-form healthchecks (CMD) run locally, got {test[0]}")
        argv = [sys.executable if a == "python" else str(self.ports.get(f"{name}:{a}", a)) for a in test[1:]]
        return subprocess.run(argv, env=self.env_for(name), cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s)

    def run_once(self, name: str, timeout_s: float = 120) -> str:
        proc = subprocess.run(self.argv_for(name), env=self.env_for(name), cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout_s)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
        return proc.stdout

    def start(self, name: str) -> Proc:
        proc = Proc(name, self.argv_for(name), self.env_for(name), self.log_dir / f"{name}.log")
        with open(proc.log_path, "ab") as log:  # the child keeps its own descriptor
            proc.popen = subprocess.Popen(proc.argv, env=proc.env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                                          start_new_session=True)
        self.procs[name] = proc
        return proc

    def credentials(self, name: str):
        """The gRPC channel credentials a client of this service uses: its environment's TLS files (the settings'
        tls_ca_file, tls_client_cert_file, tls_client_key_file), None for plain TCP."""
        from trainyard.tls import channel_credentials

        env = self.env_for(name)
        return channel_credentials(*(env.get(f"TRAINYARD_TLS_{k}_FILE") for k in ("CA", "CLIENT_CERT", "CLIENT_KEY")))

    def wait_ready(self, name: str, timeout_s: float = 90) -> None:
        from services.common.channels import wait_healthy

        proc = self.procs[name]
        deadline = time.monotonic() + timeout_s
        if name in GRPC_SERVICES:
            credentials = self.credentials(name)
            while time.monotonic() < deadline:
                self._check_alive(proc)
                try:
                    wait_healthy(self.url(name), timeout_s=2, credentials=credentials)
                    return
                except TimeoutError:
                    continue
        elif name == "worker":
            while time.monotonic() < deadline:
                self._check_alive(proc)
                if " ready." in proc.log():
                    return
                time.sleep(0.2)
        elif name == "gateway":  # the Tinker wire-protocol HTTP API (docs/gateway.md)
            while time.monotonic() < deadline:
                self._check_alive(proc)
                try:
                    with urllib.request.urlopen(f"{self.gateway_url()}/api/v1/healthz", timeout=2) as r:
                        if r.status == 200:
                            return
                except OSError:
                    time.sleep(0.3)
        elif name == "dashboard":
            env = self.env_for(name)
            # Streamlit serves HTTPS when its certificate is set (STREAMLIT_SERVER_SSL_CERT_FILE / _KEY_FILE).
            https = bool(env.get("STREAMLIT_SERVER_SSL_CERT_FILE"))
            context = ssl.create_default_context(cafile=env.get("TRAINYARD_TLS_CA_FILE")) if https else None
            while time.monotonic() < deadline:
                self._check_alive(proc)
                try:
                    with urllib.request.urlopen(f"{'https' if https else 'http'}://{self.url(name)}/_stcore/health",
                                                timeout=2, context=context) as r:
                        if r.status == 200:
                            return
                except OSError:
                    time.sleep(0.3)
        raise TimeoutError(f"{name} not ready after {timeout_s}s; log:\n{proc.log()[-4000:]}")

    @staticmethod
    def _check_alive(proc: Proc) -> None:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited with {proc.popen.returncode}; log:\n{proc.log()[-4000:]}")

    def up(self, *names: str) -> "Stack":
        """migrate, then the named services (default: every app service), each waited for."""
        self.run_once("migrate")
        names = names or tuple(n for n in self.services if n not in INFRA and n != "migrate")
        for name in names:
            self.start(name)
        for name in names:
            self.wait_ready(name)
        return self

    def stop(self, name: str, timeout_s: float = 60) -> int:
        proc = self.procs.pop(name)
        if proc.popen.poll() is None:
            os.killpg(proc.popen.pid, signal.SIGTERM)
            try:
                proc.popen.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.popen.pid, signal.SIGKILL)
                proc.popen.wait()
        return proc.popen.returncode

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait()

    def down(self) -> None:
        for name in list(self.procs)[::-1]:
            self.stop(name)
