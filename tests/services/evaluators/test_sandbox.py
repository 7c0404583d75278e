"""The evaluator sandbox (services/evaluators/sandbox.py): escape attempts are refused or killed with a clear
per-row error, and the same sandbox goes on scoring the next row. Limits are small so the kills come quickly."""
from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from services.evaluators.sandbox import EvaluatorError, Limits, Sandbox, SandboxUnavailable, Score

ROOT = Path(__file__).resolve().parents[3]
LIMITS = Limits(cpu_s=1, memory_mb=512, wall_s=3, max_processes=8)

ATTACKS = '''\
import os, socket, time


def reward_fn(completion, row):
    print("noise from the evaluator", completion)
    if completion == "read":
        return float(len(open(row["path"], "rb").read()))
    if completion == "write":
        with open(row["path"], "w") as f:
            f.write("x")
        return 1.0
    if completion == "socket":
        socket.create_connection(("127.0.0.1", row["port"]), timeout=1)
        return 1.0
    if completion == "fork bomb":
        while True:
            os.fork()
    if completion == "allocate":
        return float(len(bytearray(10 * 2**30)))
    if completion == "spin in children":
        for _ in range(3):
            if os.fork() == 0:
                while True:
                    pass
        os.wait()
    if completion in ("spin", "spin past SIGXCPU", "print past SIGXCPU"):
        if completion != "spin":
            import resource, signal
            signal.signal(signal.SIGXCPU, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_CPU, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        while True:
            if completion == "print past SIGXCPU":
                print("busy")
    if completion == "sleep":
        time.sleep(10**6)
    if completion == "raise":
        raise ValueError("no answer in " + repr(row["q"]))
    if completion == "environ":
        return float(len([k for k in row["names"] if k in os.environ]))
    if completion == "forge":  # a reply of its own on every descriptor the worker holds open
        import json, struct
        body = json.dumps({"value": "abc"}).encode()
        for fd in map(int, os.listdir("/proc/self/fd")):
            try:
                os.write(fd, struct.pack(">I", len(body)) + body) if fd > 2 else None
            except OSError:
                pass
        return 1.0
    if completion == "list":
        return float(sum(len(os.listdir(p)) for p in row["paths"] if os.path.isdir(p)))
    if completion == "import":
        import numpy  # noqa: F401
    if completion in ("abc", "nan", "none"):
        return {"abc": "abc", "nan": float("nan"), "none": None}[completion]
    return float(len(completion))
'''


def _line(source: str, text: str) -> int:
    return next(n for n, line in enumerate(source.splitlines(), 1) if text in line)


def _code(tmp_path_factory, name: str, source: str, **extra: str) -> Path:
    folder = tmp_path_factory.mktemp(name)
    (folder / "evaluator.py").write_text(textwrap.dedent(source))
    for filename, text in extra.items():
        (folder / filename).write_text(textwrap.dedent(text))
    return folder


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory):
    os.environ["TRAINYARD_TEST_SECRET"] = "s3cret"  # the host's environment must not reach the evaluator
    with Sandbox(_code(tmp_path_factory, "attacks", ATTACKS), limits=LIMITS) as sandbox:
        assert sandbox.kind == "reward_fn"
        yield sandbox
    os.environ.pop("TRAINYARD_TEST_SECRET")


def _attack(sandbox: Sandbox, completion: str, row: dict | None = None) -> Score:
    """Score the attack, then an ordinary row: the sandbox must still answer it (restarted if it was killed)."""
    attack, after = sandbox.score([(completion, row or {}), ("fine", {})])
    assert after == Score(4.0), after
    return attack


@pytest.mark.parametrize("path", ["/etc/passwd", str(ROOT / "pyproject.toml"), "/root/.bashrc",
                                  "/proc/1/environ"])
def test_files_outside_the_sandbox_are_not_there(sandbox, path):
    score = _attack(sandbox, "read", {"path": path})
    assert score.value is None and ("FileNotFoundError" in score.error or "PermissionError" in score.error), score


def test_the_blob_store_is_not_there(sandbox, tmp_path):
    blob = tmp_path / "blobs" / "ab" / "abcdef"
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"a stored dataset")
    score = _attack(sandbox, "read", {"path": str(blob)})
    assert score.value is None and score.error.startswith("FileNotFoundError"), score


@pytest.mark.parametrize("path", ["/evaluator/evaluator.py", "/usr/x", "/sandbox/worker.py", "/x"])
def test_writes_outside_scratch_are_refused(sandbox, path):
    score = _attack(sandbox, "write", {"path": path})
    assert score.value is None and ("Read-only file system" in score.error or "Permission" in score.error), score


def test_scratch_and_tmp_are_writable(sandbox):
    assert _attack(sandbox, "write", {"path": "/scratch/out.txt"}) == Score(1.0)
    assert _attack(sandbox, "write", {"path": "/tmp/out.txt"}) == Score(1.0)


def test_no_network(sandbox):
    try:  # the host side listens (Postgres): inside the sandbox the same address must fail
        socket.create_connection(("127.0.0.1", 5432), timeout=2).close()
    except OSError:
        pytest.skip("nothing listens on 127.0.0.1:5432 on this host")
    score = _attack(sandbox, "socket", {"port": 5432})
    assert score.value is None and ("Connection refused" in score.error or "unreachable" in score.error), score


def test_a_fork_bomb_is_refused(sandbox):
    score = _attack(sandbox, "fork bomb")
    assert score.value is None and "Resource temporarily unavailable" in score.error, score


def test_allocating_10_gb_is_killed(sandbox):
    assert _attack(sandbox, "allocate") == Score(None, "killed: memory limit 512 MB")


def test_a_busy_loop_is_killed_on_cpu_time(tmp_path_factory):
    limits = Limits(cpu_s=1, memory_mb=512, wall_s=60, max_processes=8)  # the wall clock far off, on a busy host too
    with Sandbox(_code(tmp_path_factory, "spin", ATTACKS), limits=limits) as sandbox:
        assert _attack(sandbox, "spin") == Score(None, "killed: CPU limit 1 s")
        # Ignoring SIGXCPU and lifting its own soft limit leaves the parent's watch on its CPU time.
        assert _attack(sandbox, "spin past SIGXCPU") == Score(None, "killed: CPU limit 1 s")
        assert _attack(sandbox, "print past SIGXCPU") == Score(None, "killed: CPU limit 1 s")  # output flowing
        # Children inherit the worker's soft limit, which counts from its own usage: the parent counts theirs too.
        assert _attack(sandbox, "spin in children") == Score(None, "killed: CPU limit 1 s")


def test_sleeping_forever_is_killed_on_the_wall_clock(sandbox):
    started = time.monotonic()
    assert _attack(sandbox, "sleep") == Score(None, "killed: wall-clock limit 3 s")
    assert time.monotonic() - started < 10


def test_exceptions_and_non_numbers_are_per_row_errors(sandbox):
    got = sandbox.score([("raise", {"q": "2+2"}), ("abc", {}), ("nan", {}), ("none", {}), ("fine", {})])
    assert got == [Score(None, f"ValueError: no answer in '2+2' (line {_line(ATTACKS, 'raise ValueError')})"),
                   Score(None, "returned 'abc' (str), not a number"),
                   Score(None, "returned nan, not a finite number"),
                   Score(None, "returned None (NoneType), not a number"),
                   Score(4.0)]


def test_prints_do_not_corrupt_results_and_are_kept(sandbox):
    assert sandbox.score([("hello", {})]) == [Score(5.0)]
    assert "noise from the evaluator hello" in sandbox.stderr_tail()


def test_a_forged_reply_is_a_protocol_error_not_a_result(sandbox):
    score = _attack(sandbox, "forge")
    assert score.value is None and score.error.startswith("protocol error"), score


def test_the_environment_is_empty(sandbox):
    host = [name for name in os.environ if name not in ("HOME", "TMPDIR", "LANG", "LC_CTYPE", "PWD")]
    assert "TRAINYARD_TEST_SECRET" in host and "PATH" in host
    assert _attack(sandbox, "environ", {"names": host}) == Score(0.0)


def test_installed_packages_are_hidden(sandbox):
    """The interpreter's site-packages and the system's dist-packages are empty inside, whatever sys.path says."""
    import sys
    import sysconfig

    sites = {sysconfig.get_paths(vars={"base": sys.base_prefix, "platbase": sys.base_prefix})["purelib"],
             *map(str, Path("/usr/lib").glob("python3*/dist-packages"))}
    here = [p for p in sites if os.path.isdir(p) and os.listdir(p)]
    assert here, "nothing installed on this host to hide"
    assert _attack(sandbox, "list", {"paths": here}) == Score(0.0)


def test_third_party_packages_are_not_importable(sandbox, tmp_path_factory):
    assert _attack(sandbox, "import") == Score(
        None, f"ModuleNotFoundError: No module named 'numpy' (line {_line(ATTACKS, 'import numpy')})")
    with Sandbox(_code(tmp_path_factory, "numpy", "import numpy\n"), limits=LIMITS) as broken:
        with pytest.raises(EvaluatorError, match=r"loading evaluator.py: ModuleNotFoundError: No module named "
                                                 r"'numpy' \(line 1\)"):
            broken.kind


def test_load_errors_name_the_problem(tmp_path_factory):
    cases = {"syntax": ("def reward_fn(c, row)\n    return 1\n", "SyntaxError: expected ':' (line 1)"),
             "nothing": ("x = 1\n", "evaluator.py defines neither reward_fn(completion, row) nor class Environment")}
    for name, (source, message) in cases.items():
        with Sandbox(_code(tmp_path_factory, name, source), limits=LIMITS) as broken:
            with pytest.raises(EvaluatorError, match=re.escape(f"loading evaluator.py: {message}")):
                broken.kind
            with pytest.raises(EvaluatorError, match=re.escape(message)):  # and again, without a new process
                broken.score([("a", {})])


def test_a_package_imports_its_own_modules(tmp_path_factory):
    code = _code(tmp_path_factory, "package", """\
        from helpers import parse

        def reward_fn(completion, row):
            return 1.0 if parse(completion) == row["answer"] else 0.0
        """, **{"helpers.py": "def parse(text):\n    return int(text.split()[-1])\n"})
    with Sandbox(code, limits=LIMITS) as sandbox:
        got = sandbox.score([("the answer is 4", {"answer": 4}), ("it is 5", {"answer": 4}), ("none", {"answer": 4})])
    assert got == [Score(1.0), Score(0.0), Score(None, "ValueError: invalid literal for int() with base 10: 'none' "
                                                       "(helpers.py line 2)")]


ENVIRONMENT = '''\
class Environment:
    """Guess the number: 'higher' / 'lower' until the guess is right (reward 1) or three guesses are used."""

    def reset(self, row):
        self.target, self.left = row["target"], 3
        return "guess a number from 1 to 10"

    def step(self, action):
        self.left -= 1
        guess = int(action)
        if guess == self.target:
            return "right", 1.0, True
        return ("higher" if guess < self.target else "lower"), 0.0, self.left == 0
'''


def test_a_multi_turn_environment_episode(tmp_path_factory):
    with Sandbox(_code(tmp_path_factory, "env", ENVIRONMENT), limits=LIMITS) as sandbox:
        assert sandbox.kind == "environment"
        assert sandbox.reset({"target": 7}) == "guess a number from 1 to 10"
        assert sandbox.step("5") == ("higher", 0.0, False)
        assert sandbox.step("8") == ("lower", 0.0, False)
        assert sandbox.step("7") == ("right", 1.0, True)
        assert sandbox.reset({"target": 2}) == "guess a number from 1 to 10"
        line = _line(ENVIRONMENT, "int(action)")
        with pytest.raises(EvaluatorError, match=rf"step: ValueError: invalid literal .*'two' \(line {line}\)"):
            sandbox.step("two")
        assert sandbox.step("2") == ("right", 1.0, True)  # the episode survives an exception in one step
        with pytest.raises(EvaluatorError, match="defines class Environment, not reward_fn"):
            sandbox.score([("a", {})])


COUNTING_ENVIRONMENT = """\
import time

BUILT = []


class Environment:
    \"\"\"Sums the actions it is sent; 'sleep' outlives the wall clock. BUILT counts instances in the worker.\"\"\"

    def __init__(self):
        BUILT.append(1)

    def reset(self, row):
        self.total, self.turns = row["start"], row["turns"]
        return f"start {self.total} ({len(BUILT)} built)"

    def step(self, action):
        if action == "sleep":
            time.sleep(60)
        self.total += int(action)
        self.turns -= 1
        return str(self.total), float(self.total), self.turns == 0
"""


def test_interleaved_episodes_each_have_an_instance(tmp_path_factory):
    """Episodes keyed by id do not share state; done frees an instance, close ends one early, the cap refuses the
    episode past it, and a kill ends every episode in progress while the sandbox goes on."""
    code = _code(tmp_path_factory, "counting", COUNTING_ENVIRONMENT)
    with Sandbox(code, limits=LIMITS, max_episodes=3) as sandbox:
        assert sandbox.reset({"start": 0, "turns": 2}, episode="a") == "start 0 (2 built)"  # 1: built at load
        assert sandbox.reset({"start": 100, "turns": 3}, episode="b") == "start 100 (3 built)"
        assert sandbox.step("1", episode="a") == ("1", 1.0, False)
        assert sandbox.step("5", episode="b") == ("105", 105.0, False)
        assert sandbox.step("2", episode="a") == ("3", 3.0, True)  # done: a's instance is freed
        assert sandbox.open_episodes == 1
        with pytest.raises(EvaluatorError, match="no episode 'a' in progress"):
            sandbox.step("1", episode="a")
        assert sandbox.step("5", episode="b") == ("110", 110.0, False)  # b never saw a's actions
        sandbox.reset({"start": 0, "turns": 9}, episode="c")
        sandbox.reset({"start": 0, "turns": 9}, episode="d")
        with pytest.raises(EvaluatorError, match=r"3 episodes are open, the sandbox's cap \(max_episodes 3\)"):
            sandbox.reset({"start": 0, "turns": 9}, episode="e")
        sandbox.close_episode("c")
        assert sandbox.open_episodes == 2
        with pytest.raises(EvaluatorError, match="no episode 'c' in progress"):
            sandbox.step("1", episode="c")
        assert sandbox.reset({"start": 7, "turns": 1}, episode="e") == "start 7 (6 built)"
        with pytest.raises(EvaluatorError, match="step: killed: wall-clock limit 3 s"):
            sandbox.step("sleep", episode="d")
        assert sandbox.open_episodes == 0  # the kill took b, d and e with the process
        with pytest.raises(EvaluatorError, match="no episode 'b' in progress"):
            sandbox.step("1", episode="b")
        assert sandbox.reset({"start": 1, "turns": 1}, episode="b") == "start 1 (2 built)"  # a fresh process
        assert sandbox.step("1", episode="b") == ("2", 2.0, True)
        assert sandbox.reset({"start": 4, "turns": 1}) == "start 4 (2 built)"  # the one built at load
        assert sandbox.step("1") == ("5", 5.0, True)


def test_without_bubblewrap_evaluators_are_refused(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path_factory.mktemp("empty")))
    with Sandbox(_code(tmp_path_factory, "plain", "def reward_fn(c, row):\n    return 1.0\n")) as sandbox:
        with pytest.raises(SandboxUnavailable, match="needs bubblewrap"):
            sandbox.score([("a", {})])


def test_the_fast_path(sandbox):
    """rows/s of a trivial reward_fn over 1000 rows, through one sandboxed worker (printed; no timing assert)."""
    items = [(f"completion {i}", {"i": i}) for i in range(1000)]
    started = time.perf_counter()
    scores = sandbox.score(items)
    elapsed = time.perf_counter() - started
    assert scores == [Score(float(len(c))) for c, _ in items]
    print(f"evaluator sandbox: {len(items) / elapsed:.0f} rows/s ({elapsed * 1000 / len(items):.2f} ms/row)")


def test_crashing_and_closing_its_own_output_are_per_row_errors(tmp_path_factory):
    code = _code(tmp_path_factory, "crasher", """\
        import os

        def reward_fn(completion, row):
            if completion == "exit":
                print("going away")
                os._exit(3)
            if completion == "close":
                os.close(1)
                os.close(2)
            return 1.0
        """)
    with Sandbox(code, limits=LIMITS) as sandbox:
        assert sandbox.score([("exit", {}), ("fine", {})]) == [
            Score(None, "crashed: the evaluator process exited with code 3; its last output: going away"), Score(1.0)]
        # its prints now go nowhere; the protocol does not depend on them
        assert sandbox.score([("close", {}), ("fine", {})]) == [Score(1.0), Score(1.0)]


NON_ROOT = '''\
import sys, time
sys.path.insert(0, sys.argv[1])
from pathlib import Path
from services.evaluators.sandbox import Limits, Sandbox
with Sandbox(Path(sys.argv[2]), limits=Limits(cpu_s=1, memory_mb=512, wall_s=3, max_processes=8)) as s:
    for c, row in [("read", {"path": "/etc/passwd"}), ("socket", {"port": 5432}), ("fork bomb", {}), ("allocate", {}),
                   ("sleep", {}), ("fine", {})]:
        print(c, "|", s.score([(c, row)])[0].error)
'''


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("runuser") or not os.path.exists("/usr/bin/python3"),
                    reason="needs root to switch to an unprivileged user, and a system interpreter it can run")
def test_as_an_unprivileged_user_bwrap_uses_a_user_namespace(tmp_path_factory):
    """Run by a non-root service user, the sandbox makes a user namespace instead of switching uid: the same
    refusals and kills. (The package and the evaluator are copied where that user can read them.)"""
    with tempfile.TemporaryDirectory() as tmp:  # pytest's own temp dirs are private to root
        root, code = Path(tmp) / "lib", Path(tmp) / "code"
        (root / "services" / "evaluators").mkdir(parents=True)
        for name in ("__init__.py", "sandbox.py", "sandbox_worker.py"):
            shutil.copy(ROOT / "services" / "evaluators" / name, root / "services" / "evaluators" / name)
        shutil.copy(ROOT / "services" / "__init__.py", root / "services" / "__init__.py")
        shutil.copytree(_code(tmp_path_factory, "non_root_code", ATTACKS), code)
        subprocess.run(["chmod", "-R", "a+rX", tmp], check=True)
        out = subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/python3", "-c", NON_ROOT, str(root),
                              str(code)], capture_output=True, text=True, timeout=120, cwd="/")
    errors = dict(line.split(" | ", 1) for line in out.stdout.splitlines())
    assert errors.keys() == {"read", "socket", "fork bomb", "allocate", "sleep", "fine"}, out.stdout + out.stderr
    assert errors["read"].startswith("FileNotFoundError") and "Connection refused" in errors["socket"]
    assert "Resource temporarily unavailable" in errors["fork bomb"]
    assert (errors["allocate"], errors["sleep"], errors["fine"]) == (
        "killed: memory limit 512 MB", "killed: wall-clock limit 3 s", "")
