"""PlanJob's numbers, from the trainer's own code in a child process.

A plan needs the tokenizer, the trainer's masks and its seeded split (services/trainer/data.py), all of which import
torch, and the scheduler's process never does. So one long-lived child (`python -m services.trainer.plan`) computes
plans: it keeps the tokenized examples per (dataset sha256, model path, max_seq_len, method), so a form that calls
PlanJob on every change pays for tokenizing once. It answers one JSON line per request line, in order, so calls
take turns (a lock). This side keeps the finished plans per full request too.
"""
from __future__ import annotations

import json
import subprocess
import sys
import threading
from collections import OrderedDict

from services.common.blobstore import BlobStore
from services.common.errors import DataLoss, TrainyardError

PLANS_KEPT = 256


class PlannerFailed(TrainyardError):
    """The planner process died or could not plan: an INTERNAL error, with its message."""


class Planner:
    def __init__(self, blobs: BlobStore, *, command: list[str] | None = None, env: dict[str, str] | None = None):
        self.blobs = blobs
        self.command = command or [sys.executable, "-m", "services.trainer.plan"]
        self.env = env
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()
        self._plans: OrderedDict[str, dict] = OrderedDict()

    def plan(self, method: str, model_path: str, dataset_sha256: str, settings: dict, *, what: str = "dataset") -> dict:
        """The plan of a checked request (the child's answer, see services/trainer/plan.py); DataLoss naming what
        when the dataset's stored bytes are damaged."""
        request = {"method": method, "model_path": model_path, "dataset_sha256": dataset_sha256,
                   "dataset_path": str(self.blobs.path(dataset_sha256)), "settings": settings}
        key = json.dumps(request, sort_keys=True)
        with self._lock:
            if key in self._plans:
                self._plans.move_to_end(key)
                return self._plans[key]
            answer = self._ask(key)
            if "data_loss" in answer:  # not kept: the next request reads the blob again
                raise DataLoss(f"{what}: {answer['data_loss']}")
            self._plans[key] = answer
            if len(self._plans) > PLANS_KEPT:
                self._plans.popitem(last=False)
            return answer

    def _ask(self, line: str) -> dict:
        if self._proc is None or self._proc.poll() is not None:
            # stderr is inherited: the child's tracebacks land in the scheduler's log.
            self._proc = subprocess.Popen(self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                          env=self.env, bufsize=1)
        try:
            self._proc.stdin.write(line + "\n")
            self._proc.stdin.flush()
            reply = self._proc.stdout.readline()
        except BrokenPipeError:  # it died since the last request
            reply = ""
        if not reply:
            code = self._proc.wait()
            self._proc = None
            raise PlannerFailed(f"the planner process exited (status {code}); see the scheduler's log")
        answer = json.loads(reply)
        if "error" in answer:
            raise PlannerFailed(f"planning failed: {answer['error']}")
        return answer

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.stdin.close()  # the child ends at end of input
                self._proc.wait()
            self._proc = None
