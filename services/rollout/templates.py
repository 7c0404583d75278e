"""Chat templates run outside the rollout process, with CPU-time and memory limits.

A model's chat template is user content (an imported model's, or one published with a full-weight version), and a
Jinja template, even sandboxed, can loop for hours or allocate without bound. So the rollout never renders one in its
own threads: a pool of at most `workers` worker processes (services/rollout/template_worker.py, started on first use,
each rendering one template at a time) does, and a render that goes past `cpu_s` seconds of CPU or `memory_mb` of
memory fails with an error naming the model whose template it is. The worker enforces both limits itself; the parent
also kills a worker whose render has used a second more CPU than allowed (one that something kept from stopping) and
starts another on the next render. close() kills every worker, so a render in flight never holds the rollout's
shutdown (a render waiting on one fails at once).
"""
from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
from pathlib import Path

from services.common.errors import InvalidArgument, ResourceExhausted, Unavailable

ROOT = Path(__file__).resolve().parents[2]
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class _Worker:
    def __init__(self, cpu_s: int, memory_mb: int):
        # The worker's own allocator: an LD_PRELOADed one reserving address space up front would eat its memory cap.
        env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "services.rollout.template_worker", str(cpu_s),
                                      str(memory_mb)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     cwd=ROOT)

    def cpu_seconds(self) -> float:
        """utime + stime of the worker (fields 14 and 15 of /proc/<pid>/stat)."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            return 0.0
        return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS

    def render(self, request: dict, cpu_limit_s: float) -> dict:
        """The worker's reply; {"error": "cpu"} when it had to be killed past cpu_limit_s of CPU for this render,
        {"error": "died"} when it ended otherwise (killed by close, or crashed)."""
        start = self.cpu_seconds()
        try:
            self.proc.stdin.write(json.dumps(request).encode() + b"\n")
            self.proc.stdin.flush()
            while not select.select([self.proc.stdout], [], [], 1.0)[0] and self.proc.poll() is None:
                if self.cpu_seconds() - start > cpu_limit_s:
                    self.kill()
                    return {"error": "cpu", "message": ""}
            line = self.proc.stdout.readline()
        except (OSError, ValueError):  # its pipes broke or were closed: it is gone
            line = b""
        return json.loads(line) if line else {"error": "died", "message": f"exit status {self.proc.wait()}"}

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            pipe.close()


class TemplateSandbox:
    def __init__(self, workers: int = 2, cpu_s: int = 1, memory_mb: int = 512):
        self.max_workers, self.cpu_s, self.memory_mb = workers, cpu_s, memory_mb
        self._cv = threading.Condition()
        self._idle: list[_Worker] = []
        self._busy: set[_Worker] = set()
        self._closed = False

    def render(self, model: str, template: str, messages: list[dict], *, add_generation_prompt: bool,
               variables: dict) -> str:
        """The conversation rendered by the template, as apply_chat_template(tokenize=False) renders it
        (variables: the tokenizer's special tokens)."""
        worker = self._take()
        reply = worker.render({"template": template, "messages": messages,
                               "add_generation_prompt": add_generation_prompt, "variables": variables},
                              self.cpu_s + 1)
        self._give_back(worker)
        if "text" in reply:
            return reply["text"]
        if reply["error"] == "died":
            raise Unavailable("the rollout is shutting down" if self._closed else
                              f"the chat template worker rendering '{model}''s template ended ({reply['message']})")
        if reply["error"] == "cpu":
            raise ResourceExhausted(f"the chat template of '{model}' was stopped after {self.cpu_s} s of CPU (the "
                                    "rollout's chat_template_cpu_s); fix the template or ask with tokens")
        if reply["error"] == "memory":
            raise ResourceExhausted(f"the chat template of '{model}' needed more than {self.memory_mb} MB (the "
                                    "rollout's chat_template_memory_mb); fix the template or ask with tokens")
        raise InvalidArgument(f"the chat template of '{model}' rejected the conversation: {reply['message']}",
                              field="prompt.messages")

    def _take(self) -> _Worker:
        with self._cv:
            while not self._idle and len(self._busy) >= self.max_workers and not self._closed:
                self._cv.wait()
            if self._closed:
                raise Unavailable("the rollout is shutting down")
            worker = self._idle.pop() if self._idle else _Worker(self.cpu_s, self.memory_mb)
            self._busy.add(worker)
            return worker

    def _give_back(self, worker: _Worker) -> None:
        with self._cv:
            self._busy.discard(worker)
            keep = worker.alive and not self._closed
            if keep:
                self._idle.append(worker)
            self._cv.notify()
        if not keep:
            worker.kill()

    def close(self) -> None:
        """Kill every worker; renders in flight and waiting fail with Unavailable."""
        with self._cv:
            self._closed = True
            idle, busy = list(self._idle), list(self._busy)
            self._idle.clear()
            self._cv.notify_all()
        for worker in idle:
            worker.kill()
        for worker in busy:  # its render sees it gone and gives it back, which reaps it
            worker.proc.kill()
