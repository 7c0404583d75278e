"""The process inside the evaluator sandbox (standard library only; it runs on the plain interpreter in isolated mode).

It drops to the sandbox's user id (when started as root), sets its limits (processes, address space, file size,
open files, CPU), loads /evaluator/evaluator.py and
answers length-prefixed JSON requests on its original stdin/stdout: `score`, `reset`, `step`, `close`. An
Environment has one instance per episode id (the parent keys them and caps how many are open). The evaluator's own
prints go to stderr, so they cannot corrupt the protocol. Every exception the evaluator raises and every value that is
not a number becomes an error reply; the CPU limit is re-armed here
before each call; memory, processes and the wall clock are enforced from outside.
"""
import importlib.util
import json
import math
import os
import resource
import signal
import struct
import sys
import traceback

CODE_DIR = "/evaluator"
HEADER = struct.Struct(">I")


class Unusable(Exception):
    """The evaluator is not usable as one, or returned something that is not a result; the message says it all."""


def describe(exc: BaseException) -> str:
    """'ValueError: bad row (line 12)': the exception and the last line of the evaluator's own code it passed."""
    if isinstance(exc, Unusable):
        return str(exc)[:2000]
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    where = None
    if isinstance(exc, SyntaxError) and exc.filename and exc.filename.startswith(CODE_DIR):
        text, where = f"{type(exc).__name__}: {exc.msg}", (exc.filename, exc.lineno)
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        if frame.f_code.co_filename.startswith(CODE_DIR + "/"):
            where = (frame.f_code.co_filename, lineno)
    if where:
        name = os.path.relpath(where[0], CODE_DIR)
        text += f" (line {where[1]})" if name == "evaluator.py" else f" ({name} line {where[1]})"
    return text[:2000]


def shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def number(value, what: str) -> float:
    if isinstance(value, (int, float)):
        value = float(value)
        if math.isfinite(value):
            return value
        raise Unusable(f"{what} {shown(value)}, not a finite number")
    raise Unusable(f"{what} {shown(value)} ({type(value).__name__}), not a number")


class Worker:
    def __init__(self, module):
        self.reward_fn = getattr(module, "reward_fn", None)
        environment = getattr(module, "Environment", None)
        if callable(self.reward_fn):
            self.kind = "reward_fn"
        elif isinstance(environment, type):
            self.kind = "environment"
            self.environment = environment
            self.envs = {"": environment()}  # episode id -> its instance; "" is built at load (the plain API's)
        else:
            raise Unusable("evaluator.py defines neither reward_fn(completion, row) nor class Environment")

    def score(self, completion: str, row: dict) -> dict:
        return {"value": number(self.reward_fn(completion, row), "returned")}

    def reset(self, row: dict, episode: str = "") -> dict:
        if episode not in self.envs:
            self.envs[episode] = self.environment()  # a new episode gets an instance of its own
        observation = self.envs[episode].reset(row)
        if not isinstance(observation, str):
            raise Unusable(f"reset returned {shown(observation)} ({type(observation).__name__}), not a str")
        return {"observation": observation}

    def close(self, episode: str) -> dict:
        if episode:
            self.envs.pop(episode, None)
        return {}

    def step(self, action: str, episode: str = "") -> dict:
        out = self.envs[episode].step(action)
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise Unusable(f"step returned {shown(out)}, not (observation, reward, done)")
        observation, reward, done = out
        if not isinstance(observation, str):
            raise Unusable(f"step returned observation {shown(observation)} ({type(observation).__name__}), "
                            "not a str")
        if not isinstance(done, (bool, int)):
            raise Unusable(f"step returned done {shown(done)} ({type(done).__name__}), not a bool")
        reward = number(reward, "step returned reward")
        if done and episode:
            del self.envs[episode]  # its episode is over: the instance is freed
        return {"observation": observation, "reward": reward, "done": bool(done)}


def main() -> None:
    config = json.loads(sys.argv[1])
    cpu_s = config["cpu_s"]
    pid = os.getpid()
    requests = os.fdopen(os.dup(0), "rb", buffering=0)
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(os.open("/dev/null", os.O_RDONLY), 0)
    os.dup2(2, 1)  # the evaluator's prints go to stderr, never into the protocol
    sys.stdout = sys.stderr
    if config["uid"]:
        os.setgroups([])
        os.setgid(config["uid"])
        os.setuid(config["uid"])
    # The limits, before any evaluator code runs (here rather than in the parent between fork and exec, which is not
    # safe in a multi-threaded parent such as a gRPC server). NPROC binds now that the uid is the sandbox's own.
    for name, value in (("RLIMIT_NPROC", config["max_processes"]), ("RLIMIT_AS", config["memory_bytes"]),
                        ("RLIMIT_FSIZE", config["file_bytes"]), ("RLIMIT_NOFILE", config["open_files"])):
        resource.setrlimit(getattr(resource, name), (value, value))
    resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(cpu_s), resource.RLIM_INFINITY))  # loading; re-armed per call

    def send(message: dict) -> None:
        if os.getpid() != pid:
            os._exit(0)  # a process the evaluator forked: only the worker answers
        try:
            os.kill(-1, signal.SIGKILL)  # processes the evaluator started do not outlive the call
        except ProcessLookupError:
            pass
        body = json.dumps(message).encode()
        replies.write(HEADER.pack(len(body)) + body)

    def read_exact(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = requests.read(n - len(data))
            if not chunk:
                raise SystemExit(0)
            data += chunk
        return data

    sys.path.insert(0, CODE_DIR)
    try:
        spec = importlib.util.spec_from_file_location("evaluator", os.path.join(CODE_DIR, "evaluator.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules["evaluator"] = module
        spec.loader.exec_module(module)
        worker = Worker(module)
    except MemoryError:
        send({"memory": True})
        return
    except BaseException as exc:  # noqa: BLE001 - anything the evaluator raises while loading is its error
        send({"error": describe(exc)})
        return
    send({"kind": worker.kind})
    while True:
        request = json.loads(read_exact(HEADER.unpack(read_exact(HEADER.size))[0]))
        op = request.pop("op")
        # RLIMIT_CPU per call: the soft limit (SIGXCPU ends the process) at this process's CPU time so far + cpu_s.
        # The parent also watches the CPU time, for code that blocks SIGXCPU or raises the limit itself.
        used = sum(os.times()[:2])
        resource.setrlimit(resource.RLIMIT_CPU, (math.ceil(used + cpu_s), resource.RLIM_INFINITY))
        try:
            reply = getattr(worker, op)(**request)
        except MemoryError:
            send({"memory": True})
            return
        except BaseException as exc:  # noqa: BLE001 - per-call errors go back to the caller as text
            reply = {"error": describe(exc)}
        send(reply)


if __name__ == "__main__":
    main()
