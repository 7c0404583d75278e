"""Run an uploaded evaluator in a sandboxed subprocess: bubblewrap namespaces, rlimits, and a wall clock.

The evaluator (evaluator.py, defining `reward_fn(completion, row) -> float` or `class Environment` with
`reset(row) -> str` and `step(action) -> (observation, reward, done)`) runs in one long-lived worker process
(sandbox_worker.py) on the plain base interpreter in isolated mode (`-I -S`: the standard library only). The process
sees a read-only view of the interpreter and system libraries, its own code read-only at /evaluator, an empty scratch
dir at /scratch and a small tmpfs at /tmp; no network (its own empty net namespace), its own pid/ipc/uts namespaces,
no environment, no capabilities. When started as root, bwrap keeps the host's user namespace and the worker drops to
a user id of its own before it loads any evaluator code, so RLIMIT_NPROC binds (the kernel never applies it to uid 0).

Limits and who enforces them: the worker sets its rlimits itself, first thing and before any evaluator code runs
(not the parent between fork and exec, which is unsafe in a multi-threaded parent such as the gRPC server).
- CPU seconds per call: RLIMIT_CPU, re-armed by the worker before each call to its CPU time so far + cpu_s (the
  kernel's SIGXCPU ends it); the parent also polls the CPU time of the worker and every process it started while it
  waits and kills the sandbox past the limit, for code that ignores SIGXCPU, raises its own soft limit or spins in
  forked children. (A hard limit re-armed from outside would need CAP_SYS_RESOURCE, which containers often lack.)
- memory: RLIMIT_AS on the worker and what it forks; a MemoryError in the evaluator also ends the worker.
- wall clock per call: the parent stops waiting and kills the sandbox (bwrap dies, its pid namespace with it).
- processes: RLIMIT_NPROC under the sandbox's own uid, and whatever the evaluator started is killed after each call;
  file size RLIMIT_FSIZE; open files RLIMIT_NOFILE; /tmp is a tmpfs of TMPFS_BYTES.
A killed or crashed worker is restarted with a fresh scratch dir on the next call; the failing row gets the reason.
Without bwrap, or where it cannot create namespaces, evaluators are refused (SandboxUnavailable): never run bare.
"""
from __future__ import annotations

import json
import math
import os
import secrets
import select
import shutil
import signal
import struct
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("sandbox_worker.py")
HEADER = struct.Struct(">I")
MAX_REPLY_BYTES = 16 << 20
STDERR_TAIL_BYTES = 4096
TMPFS_BYTES = 64 << 20
FILE_SIZE_BYTES = 64 << 20
OPEN_FILES = 256
CPU_POLL_S = 0.25  # how often the parent checks a busy worker's CPU time (the kernel's SIGXCPU normally comes first)
CPU_GRACE_S = 1.0
# Sandboxed workers run as a uid of their own drawn from this range (root hosts only), so a fork bomb in one
# evaluator counts against its own RLIMIT_NPROC and never against another sandbox or a real user.
SANDBOX_UIDS = range(400_000, 1_400_000)


class EvaluatorError(Exception):
    """The evaluator cannot be loaded or an Environment call failed; the message says why, in words."""


class SandboxUnavailable(EvaluatorError):
    """This host cannot sandbox evaluator code (no bubblewrap, or no namespaces): evaluators are refused."""


@dataclass(frozen=True)
class Limits:
    cpu_s: float = 10.0
    memory_mb: int = 1024
    wall_s: float = 30.0
    max_processes: int = 16

    def __post_init__(self):
        for name in ("cpu_s", "memory_mb", "wall_s", "max_processes"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Limits.{name} must be > 0, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class Score:
    value: float | None
    error: str = ""


class _CallError(Exception):
    """The evaluator raised or returned something that is not a result; the message is the row's error."""


class _Died(Exception):
    """The worker is gone (killed on a limit, crashed or broke the protocol); the message is the row's error."""


def _bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise SandboxUnavailable(
            "the evaluator sandbox needs bubblewrap (the `bwrap` command, Debian package `bubblewrap`); it is not "
            "installed, so evaluator code is refused rather than run unsandboxed")
    return path


def _interpreter() -> tuple[str, Path]:
    """The base interpreter (not a virtualenv's: its packages stay outside) and its installation prefix."""
    executable = os.path.realpath(getattr(sys, "_base_executable", sys.executable))
    return executable, Path(sys.base_prefix).resolve()


def _system_mounts(prefix: Path) -> list[str]:
    """Read-only binds of what the interpreter needs: /usr, the /lib* dirs (or their links), the interpreter's prefix
    with its site-packages hidden under empty tmpfs."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    if not prefix.is_relative_to("/usr"):
        for parent in reversed(prefix.parents[:-1]):  # bwrap would copy the host's modes (/root is 0700)
            args += ["--perms", "0755", "--dir", str(parent)]
        args += ["--ro-bind", str(prefix), str(prefix)]
    base = {"base": str(prefix), "platbase": str(prefix)}
    sites = {Path(sysconfig.get_paths(vars=base)[key]) for key in ("purelib", "platlib")}
    # The system's Python packages too (Debian's dist-packages under /usr): the standard library only, whatever
    # sys.path an evaluator builds for itself.
    sites |= {*Path("/usr/lib").glob("python3*/dist-packages"), *Path("/usr/local/lib").glob("python3*/*-packages")}
    for site in sorted(sites):
        if site.is_dir() and not site.is_symlink():
            args += ["--tmpfs", str(site)]
    return args


PROTOCOL_ERROR = "protocol error: a reply that is not the sandbox's (the evaluator wrote to the reply channel)"
_REPLY_TYPES = {"score": {"value": float}, "reset": {"observation": str},
                "step": {"observation": str, "reward": float, "done": bool}, "close": {}}
MAX_EPISODES = 1024  # Environment instances open at once in one sandbox (episodes started with reset, not yet ended)


def _well_formed(op: str, reply: dict) -> bool:
    """The worker's reply to op, as it sends them (a finite float reward, a str observation, a bool done)."""
    for key, kind in _REPLY_TYPES[op].items():
        value = reply.get(key)
        if not isinstance(value, kind) or (kind is float and not math.isfinite(value)):
            return False
    return True


def _tree_cpu_ticks(pid: int) -> int:
    """utime + stime of pid's threads, of its reaped children (cutime + cstime) and of its live descendants."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:  # gone meanwhile
        return 0
    try:
        children = [int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                    for c in (task / "children").read_text().split()]
    except OSError:  # exited meanwhile, or a kernel without children files: its own time only
        children = []
    return sum(int(f) for f in fields[11:15]) + sum(_tree_cpu_ticks(c) for c in children)


def _child_of(pid: int) -> int:
    """The (one) child process of pid, from the host's /proc."""
    try:
        return int(Path(f"/proc/{pid}/task/{pid}/children").read_text().split()[0])
    except (OSError, IndexError):  # a kernel without CONFIG_PROC_CHILDREN: look for the process whose parent it is
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                if int(stat.read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    return int(stat.parent.name)
            except (OSError, IndexError, ValueError):
                continue
    return 0  # gone already: the next call finds out how


class Sandbox:
    """One sandboxed worker process for one evaluator, kept alive across calls and restarted after a kill.

    Not thread-safe: one caller at a time (a recipe holds one Sandbox per worker thread)."""

    def __init__(self, code_dir: Path, *, limits: Limits = Limits(), max_episodes: int = MAX_EPISODES) -> None:
        self.limits = limits
        self.max_episodes = max_episodes
        self._root = Path(tempfile.mkdtemp(prefix="trainyard-evaluator-"))
        self._code = self._root / "code"
        shutil.copytree(code_dir, self._code, symlinks=False)
        for path in [self._code, *self._code.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        self._as_root = os.geteuid() == 0
        self._uid = SANDBOX_UIDS.start + secrets.randbelow(len(SANDBOX_UIDS)) if self._as_root else 0
        self._proc: subprocess.Popen | None = None
        self._pid = 0  # the worker's pid on the host, to watch its CPU time
        self._kind: str | None = None
        self._load_error: EvaluatorError | None = None
        self._stderr = bytearray()  # the last STDERR_TAIL_BYTES the worker wrote, across restarts
        self._stderr_open = False
        self._episodes: set[str] = set()  # the Environment episodes in progress, by id ("" for the plain API's)
        self._cpu_deadline: float | None = None  # this call's, set by the CPU watch's first look (_check_cpu)
        self._cpu_check_at = 0.0

    # -- public API ----------------------------------------------------------------------------------------------
    @property
    def kind(self) -> str:
        """'reward_fn' or 'environment'; raises EvaluatorError when the evaluator does not load."""
        self._ensure_started()
        return self._kind

    def score(self, items: Sequence[tuple[str, dict]]) -> list[Score]:
        """One Score per (completion, row), in order; a failing row gets Score(None, reason) and the next row runs."""
        if self.kind != "reward_fn":
            raise EvaluatorError("this evaluator defines class Environment, not reward_fn: use reset/step")
        scores = []
        for completion, row in items:
            try:
                scores.append(Score(self._call({"op": "score", "completion": completion, "row": row})["value"]))
            except (_Died, _CallError, EvaluatorError) as exc:  # EvaluatorError: restarting it after a kill failed
                scores.append(Score(None, str(exc)))
        return scores

    def reset(self, row: dict, episode: str = "") -> str:
        """Start an episode: its first observation. Each episode id has an Environment instance of its own in the
        worker (created here, freed when a step returns done or with close_episode), so episodes can be interleaved;
        at most max_episodes are open at once. reset on an open id starts it again on the same instance. Without an
        id, the one instance built when the evaluator loaded is used."""
        if self.kind != "environment":
            raise EvaluatorError("this evaluator defines reward_fn, not class Environment: use score")
        if episode not in self._episodes and len(self._episodes) >= self.max_episodes:
            raise EvaluatorError(f"reset: {len(self._episodes)} episodes are open, the sandbox's cap "
                                 f"(max_episodes {self.max_episodes}); end or close one first")
        self._episodes.discard(episode)
        observation = self._env_call({"op": "reset", "row": row, "episode": episode})["observation"]
        self._episodes.add(episode)
        return observation

    def step(self, action: str, episode: str = "") -> tuple[str, float, bool]:
        """(observation, reward, done) of an action in an episode in progress. A step that raises leaves the episode
        open; one that returns done ends a keyed episode (its instance is freed); a kill of the worker ends every
        episode in progress."""
        if episode not in self._episodes:
            what = f"episode {episode!r}" if episode else "episode"
            raise EvaluatorError(f"no {what} in progress: call reset(row) first (a kill of the evaluator process "
                                 "ends every episode in progress)")
        reply = self._env_call({"op": "step", "action": action, "episode": episode})
        if reply["done"] and episode:
            self._episodes.discard(episode)
        return reply["observation"], reply["reward"], reply["done"]

    def close_episode(self, episode: str) -> None:
        """End an episode before it is done (its instance is freed); nothing when it is not in progress."""
        if episode in self._episodes:
            self._episodes.discard(episode)
            if self._proc is not None:
                self._env_call({"op": "close", "episode": episode})

    @property
    def open_episodes(self) -> int:
        return len(self._episodes)

    def stderr_tail(self) -> str:
        """The last few KB the evaluator wrote to stdout/stderr (its prints), for a job's log."""
        return self._stderr.decode(errors="replace")

    def close(self) -> None:
        self._kill()
        shutil.rmtree(self._root, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the worker process --------------------------------------------------------------------------------------
    def _env_call(self, message: dict) -> dict:
        try:
            return self._call(message)
        except _Died as exc:
            self._episodes.clear()  # the worker was killed: its instances with it
            raise EvaluatorError(f"{message['op']}: {exc}") from None
        except _CallError as exc:
            raise EvaluatorError(f"{message['op']}: {exc}") from None

    def _call(self, message: dict) -> dict:
        self._ensure_started()
        try:
            body = json.dumps(message, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            raise _CallError(f"the row cannot be sent to the evaluator as JSON: {exc}") from None
        try:
            self._proc.stdin.write(HEADER.pack(len(body)) + body)
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            pass  # it died; reading says how
        reply = self._receive(time.monotonic() + self.limits.wall_s)
        if isinstance(reply.get("error"), str):
            raise _CallError(reply["error"])
        if not _well_formed(message["op"], reply):
            self._kill()
            raise _Died(PROTOCOL_ERROR)
        return reply

    def _ensure_started(self) -> None:
        if self._load_error is not None:
            raise self._load_error
        if self._proc is not None:
            return
        info_read, info_write = os.pipe()
        try:
            self._proc = subprocess.Popen(self._command(info_write), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                          stderr=subprocess.PIPE, pass_fds=(info_write,), start_new_session=True)
        except BaseException:
            os.close(info_read)
            raise
        finally:
            os.close(info_write)
        os.set_blocking(self._proc.stderr.fileno(), False)
        self._stderr_open = True
        with os.fdopen(info_read, "rb") as info:
            raw = info.read()  # bwrap writes {"child-pid": N} and closes it; empty when it failed to start
        try:
            hello = self._receive(time.monotonic() + self.limits.wall_s)
        except _Died as exc:
            tail = self.stderr_tail()
            if not raw or "bwrap:" in tail[-1000:]:
                raise SandboxUnavailable(
                    f"the evaluator sandbox needs bubblewrap able to create namespaces on this host; it failed: "
                    f"{tail.strip()[-500:] or exc}") from None
            self._load_error = EvaluatorError(f"loading evaluator.py: {exc}")
            raise self._load_error from None
        if "error" in hello:
            self._kill()
            self._load_error = EvaluatorError(f"loading evaluator.py: {hello['error']}")
            raise self._load_error
        if hello.get("kind") not in ("reward_fn", "environment"):
            self._kill()
            raise EvaluatorError(f"loading evaluator.py: {PROTOCOL_ERROR}")
        self._kind = hello["kind"]
        self._pid = _child_of(json.loads(raw)["child-pid"])  # bwrap's reaper is pid 1 there; the worker its child

    def _command(self, info_fd: int) -> list[str]:
        python, prefix = _interpreter()
        if self._as_root:
            namespaces = ["--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
                          "--cap-add", "CAP_SETUID,CAP_SETGID"]  # the worker drops to its own uid, then has none
        else:
            namespaces = ["--unshare-all"]
        scratch = self._root / "scratch"
        shutil.rmtree(scratch, ignore_errors=True)
        scratch.mkdir(mode=0o700)
        if self._as_root:
            os.chown(scratch, self._uid, self._uid)
        return [
            _bwrap(), *namespaces, "--die-with-parent", "--new-session", *_system_mounts(prefix),
            "--ro-bind", str(self._code), "/evaluator", "--bind", str(scratch), "/scratch",
            "--perms", "0755", "--dir", "/sandbox", "--ro-bind", str(WORKER), "/sandbox/worker.py",
            "--perms", "1777", "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp", "--proc", "/proc", "--dev", "/dev",
            "--hostname", "evaluator", "--chdir", "/scratch", "--clearenv", "--setenv", "HOME", "/scratch",
            "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG", "C.UTF-8", "--info-fd", str(info_fd),
            python, "-I", "-S", "-B", "/sandbox/worker.py", json.dumps({
                "uid": self._uid, "max_processes": self.limits.max_processes, "cpu_s": self.limits.cpu_s,
                "memory_bytes": self.limits.memory_mb << 20, "file_bytes": FILE_SIZE_BYTES, "open_files": OPEN_FILES}),
        ]

    def _cpu_seconds(self) -> float:
        """CPU time of the worker and every process it started (and reaped) so far, from the host's /proc."""
        return _tree_cpu_ticks(self._pid) / os.sysconf("SC_CLK_TCK") if self._pid else 0.0

    def _receive(self, deadline: float) -> dict:
        # The parent's CPU watch takes its baseline CPU_POLL_S into the call (a quick call costs no /proc reads):
        # lenient by what ran before that, a backstop behind the kernel's SIGXCPU.
        self._cpu_deadline = None
        self._cpu_check_at = time.monotonic() + CPU_POLL_S
        header = self._read(HEADER.size, deadline)
        (size,) = HEADER.unpack(header)
        if size > MAX_REPLY_BYTES:
            self._kill()
            raise _Died(PROTOCOL_ERROR)
        try:
            reply = json.loads(self._read(size, deadline))
            if not isinstance(reply, dict):
                raise ValueError(reply)
        except ValueError:
            self._kill()
            raise _Died(PROTOCOL_ERROR)
        if reply.get("memory"):
            self._kill()
            raise _Died(f"killed: memory limit {self.limits.memory_mb} MB")
        return reply

    def _read(self, n: int, deadline: float) -> bytes:
        out = self._proc.stdout
        data = b""
        while len(data) < n:
            now = time.monotonic()
            if now >= deadline:
                self._kill()
                raise _Died(f"killed: wall-clock limit {self.limits.wall_s:g} s")
            if now >= self._cpu_check_at:
                self._check_cpu()
            watched = [out, self._proc.stderr] if self._stderr_open else [out]
            wait = min(deadline, self._cpu_check_at) - now
            ready = select.select(watched, [], [], max(wait, 0.0))[0]
            if self._proc.stderr in ready:
                self._drain_stderr()
            if out not in ready:
                continue
            chunk = os.read(out.fileno(), n - len(data))
            if not chunk:
                raise _Died(self._death())
            data += chunk
        self._drain_stderr()  # the prints before the reply are in the pipe already
        return data

    def _check_cpu(self) -> None:
        self._cpu_check_at = time.monotonic() + CPU_POLL_S
        used = self._cpu_seconds()
        if self._cpu_deadline is None:
            self._cpu_deadline = used + self.limits.cpu_s + CPU_GRACE_S
        elif used > self._cpu_deadline:
            self._kill()
            raise _Died(f"killed: CPU limit {self.limits.cpu_s:g} s")

    def _death(self) -> str:
        """Why the worker ended on its own: the kernel's CPU kill, a memory failure, or a crash (with its stderr)."""
        code = self._proc.wait()
        os.set_blocking(self._proc.stderr.fileno(), True)
        self._drain_stderr()  # to the end: the whole sandbox is gone
        self._kill()
        if code in (128 + signal.SIGKILL, 128 + signal.SIGXCPU, -signal.SIGKILL):
            return f"killed: CPU limit {self.limits.cpu_s:g} s"
        tail = self.stderr_tail().strip()
        if "MemoryError" in tail[-300:]:
            return f"killed: memory limit {self.limits.memory_mb} MB"
        reason = f"exited with code {code}" if code >= 0 else f"killed by signal {-code}"
        return f"crashed: the evaluator process {reason}" + (f"; its last output: {tail[-1000:]}" if tail else "")

    def _kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)  # bwrap; --die-with-parent takes the whole pid namespace with it
            proc.wait()
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()

    def _drain_stderr(self) -> None:
        """Keep what the worker wrote to stderr so far (its prints, tracebacks), the last few KB of it."""
        while True:
            try:
                chunk = os.read(self._proc.stderr.fileno(), 65536)
            except BlockingIOError:
                return
            if not chunk:
                self._stderr_open = False
                return
            self._stderr += chunk
            del self._stderr[:-STDERR_TAIL_BYTES]
