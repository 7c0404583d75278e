"""A managed job's attempt on a torchrun group: start it, read rank 0's events as they come, pass the job's stop on,
and end it with the attempt.

    group_events(spec, nproc, stop=..., poll_s=...) -> the run's events (services/trainer/sft.py), as run_sft yields
                                                       them in process: the recipe records them alike

The group is `python -m torch.distributed.run --standalone --nproc-per-node N -m services.trainer.sft_group spec.json`
(c10d rendezvous on this machine), its output in group/torchrun.log. The exchange (services/trainer/sft_group.py):
rank 0 appends events to group/events.jsonl, a checkpoint's files hard-linked under group/outbox/ (removed here
when the caller asks for the next event, having stored them); the job's stop flag (a cancellation, a lost lease) is
passed on by creating group/stop, which rank 0 reads before every micro-batch.

How an attempt ends:
  - Finished: the events end; torchrun exits 0.
  - the job's own error on rank 0 (a dataset or checkpoint that does not fit): JobError with its message; the job
    fails as it would in process.
  - a rank dies (killed, out of memory, a broken collective): torchrun sees it within its monitor interval, stops
    the other ranks and exits non-zero; GroupLost, with torchrun's summary. The job shell hands the job back for a
    retry from its last checkpoint (services/worker/job.py).
  - the caller stops reading (it raised, e.g. its lease was lost): the group is terminated (SIGTERM to torchrun,
    which stops its ranks; SIGKILL to all of them after a grace period).
  - the worker process dies (kill -9): torchrun gets SIGTERM from the kernel (PR_SET_PDEATHSIG, Linux) and stops its
    ranks, so no orphaned group keeps training (and holding accelerators) beside the job's next attempt.
"""
from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from services.common.errors import AttemptLost
from services.trainer.sft import Checkpoint, Finished, SftEvent, StopFlag
from services.trainer.sft_group import EVENTS, STOP, GroupSpec, event_from_json

_PROJECT_ROOT = Path(__file__).resolve().parents[2]  # where `-m services.trainer.sft_group` imports from
_TERMINATE_GRACE_S = 40.0  # torchrun gives its ranks 30 s after SIGTERM before it kills them
_PR_SET_PDEATHSIG = 1


def _parent_death_signal():
    """A preexec_fn giving the child SIGTERM when the thread that started it dies (Linux; elsewhere None). prctl is
    looked up here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    return lambda: prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


class GroupLost(AttemptLost):
    """The group ended before the run finished: a rank died (or the group could not start)."""


class JobError(Exception):
    """The job's own error, raised on rank 0 (its exception type and message)."""


def group_events(spec: GroupSpec, nproc: int, *, stop: StopFlag, poll_s: float,
                 gpus: list[int] | None = None) -> Iterator[SftEvent]:
    """gpus: the GPUs the job holds (docs/resources.md), one per rank, made the group's CUDA_VISIBLE_DEVICES; None
    (or a count other than nproc): the group sees what the worker sees."""
    group = Path(spec.group_dir)
    group.mkdir(parents=True)
    spec_path = spec.write(group / "spec.json")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(_PROJECT_ROOT),
                                                                    os.environ.get("PYTHONPATH", "")) if p)}
    if gpus and len(gpus) == nproc:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")  # our indices count within the worker's own visible set
        names = visible.split(",") if visible else None
        env["CUDA_VISIBLE_DEVICES"] = ",".join(names[i] if names and i < len(names) else str(i) for i in gpus)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "--max-restarts", "0", "-m", "services.trainer.sft_group", str(spec_path)]
    with open(group / "torchrun.log", "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=_PROJECT_ROOT,
                                start_new_session=True, preexec_fn=_parent_death_signal())
    lines = _Lines(group / EVENTS)
    finished, error = None, None
    try:
        while True:
            exited = proc.poll() is not None  # read after the exit is seen: every line written before it
            for obj in lines.new():
                if "error" in obj:
                    error = obj["error"]
                    continue
                event = event_from_json(obj)
                finished = event if isinstance(event, Finished) else finished
                yield event
                if isinstance(event, Checkpoint):  # stored by the caller: our link to it goes
                    shutil.rmtree(event.checkpoint.root)
            if exited:
                break
            if stop.is_set() and not (group / STOP).exists():
                (group / STOP).touch()
            time.sleep(poll_s)
    finally:
        lines.close()
        _terminate(proc, group)
    if error is not None:
        raise JobError(error)
    if finished is None or proc.returncode != 0:
        raise GroupLost(f"the training group of {nproc} ranks ended before the run finished (torchrun exit code "
                        f"{proc.returncode}); torchrun's last output:\n{_tail(group / 'torchrun.log')}")


class _Lines:
    """The complete JSON lines appended to a file since the last call (a line still being written waits)."""

    def __init__(self, path: Path):
        self.path, self.file, self.partial = path, None, ""

    def new(self) -> list[dict]:
        if self.file is None:
            if not self.path.exists():
                return []
            self.file = open(self.path, encoding="utf-8")
        text = self.partial + self.file.read()
        *complete, self.partial = text.split("\n")
        return [json.loads(line) for line in complete if line.strip()]

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _terminate(proc: subprocess.Popen, group: Path) -> None:
    """End the group if it still runs: SIGTERM to torchrun (it stops its ranks), then SIGKILL to every process."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(_TERMINATE_GRACE_S)
        return
    except subprocess.TimeoutExpired:
        pass
    proc.kill()
    for pid_file in group.glob("rank*.pid"):
        try:
            os.kill(int(pid_file.read_text()), signal.SIGKILL)
        except (ValueError, ProcessLookupError):
            pass
    proc.wait()


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no output)"
