"""Faults and traffic for the reliability suite: kill -9 of a service with its restart, and threads that keep calling
an RPC, recording when each call ran and how it ended."""
from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

# After a restarted rollout reports SERVING, a client reconnects within its 2 s backoff cap and the first Sample
# loads the deployment again: calls that fail this long after the restart still count as the outage's.
RECONNECT_SLACK_S = 5.0


@dataclass
class Fault:
    service: str
    killed_at: float
    ready_at: float | None = None
    restart_error: str = ""


class Chaos:
    """SIGKILLs services of a localstack Stack and restarts each at once in the background, recording when each was
    down (from the kill until the restarted process reports ready)."""

    def __init__(self, stack):
        self.stack = stack
        self.faults: list[Fault] = []
        self._restarts: dict[str, threading.Thread] = {}

    def kill(self, name: str) -> Fault:
        if name in self._restarts:  # killed before: the process being started is the one to kill
            self._restarts.pop(name).join()
        fault = Fault(name, time.monotonic())
        self.stack.kill(name)
        self.faults.append(fault)
        thread = threading.Thread(target=self._restart, args=(fault,), name=f"restart-{name}", daemon=True)
        thread.start()
        self._restarts[name] = thread
        return fault

    def _restart(self, fault: Fault) -> None:
        log = self.stack.log_dir / f"{fault.service}.log"
        offset = log.stat().st_size if log.exists() else 0
        try:
            self.stack.start(fault.service)
            if fault.service == "worker":  # its log is appended to: only what this process wrote tells
                self._wait_log(fault.service, log, offset, " ready.")
            else:
                self.stack.wait_ready(fault.service, timeout_s=180)
            fault.ready_at = time.monotonic()
        except Exception as exc:  # noqa: BLE001 - reported by join(), in the test's thread
            fault.restart_error = f"{type(exc).__name__}: {exc}"

    def _wait_log(self, name: str, log, offset: int, marker: str, timeout_s: float = 180) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with open(log, "rb") as f:
                f.seek(offset)
                if marker.encode() in f.read():
                    return
            if self.stack.procs[name].popen.poll() is not None:
                raise RuntimeError(f"{name} exited with {self.stack.procs[name].popen.returncode}")
            time.sleep(0.2)
        raise TimeoutError(f"{name} not ready after {timeout_s}s")

    def join(self) -> None:
        """Wait for every restart; fail if one did not come back."""
        for thread in self._restarts.values():
            thread.join()
        self._restarts.clear()
        failed = [f"{f.service}: {f.restart_error}" for f in self.faults if f.restart_error or f.ready_at is None]
        assert not failed, f"services did not come back: {failed}"

    def outages(self, service: str, slack_s: float = 0.0, needs: tuple[str, ...] = ()) -> list[tuple[float, float]]:
        """When service was down, each window running on until slack_s after it was ready again, or after the last
        of the services it needs to come back (`needs`) was, if one of those was down while it restarted."""
        windows = []
        for f in self.faults:
            if f.service != service:
                continue
            end = f.ready_at or float("inf")
            for g in self.faults:
                if g.service in needs and g.killed_at <= end + slack_s and (g.ready_at or float("inf")) >= f.killed_at:
                    end = max(end, g.ready_at or float("inf"))
            windows.append((f.killed_at, end + slack_s))
        return windows


@dataclass
class Call:
    started: float
    ended: float
    code: str

    @property
    def seconds(self) -> float:
        return self.ended - self.started


@dataclass
class Traffic:
    """Threads calling `call()` in a loop until stopped; each call's start, end and status code are kept."""

    call: Callable[[], object]
    threads: int
    name: str = "traffic"
    calls: list[Call] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _workers: list[threading.Thread] = field(default_factory=list)

    def start(self) -> Traffic:
        for i in range(self.threads):
            t = threading.Thread(target=self._run, name=f"{self.name}-{i}", daemon=True)
            t.start()
            self._workers.append(t)
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            t0 = time.monotonic()
            try:
                self.call()
                code = "OK"
            except grpc.RpcError as exc:
                code = exc.code().name if hasattr(exc, "code") else "UNKNOWN"
                self._stop.wait(0.2)  # a server that is down refuses at once: do not spin
            self.calls.append(Call(t0, time.monotonic(), code))

    def wait_ok_after(self, t: float, timeout_s: float = 120) -> None:
        """Until a call started after t succeeded (the service answers again)."""
        deadline = time.monotonic() + timeout_s
        while not any(c.code == "OK" and c.started > t for c in self.calls):
            assert time.monotonic() < deadline, f"{self.name}: no successful call after the restart"
            time.sleep(0.1)

    def stop(self) -> None:
        self._stop.set()
        for t in self._workers:
            t.join()

    def errors_outside(self, windows: list[tuple[float, float]]) -> list[Call]:
        """Failed calls that overlap none of the windows."""
        return [c for c in self.calls if c.code != "OK"
                and not any(c.started <= end and c.ended >= start for start, end in windows)]


def rss_mb(pid: int) -> float:
    """Resident memory of a service: its process group (the service and any children it started), in MB."""
    total = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read().rsplit(")", 1)[1].split()
            if int(stat[2]) != pid:  # process group id
                continue
            with open(f"/proc/{entry}/status") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
        except (FileNotFoundError, ProcessLookupError, StopIteration):
            continue
    return total / 1024
