"""The controller -> workers seam (services/trainer/engine/parallel/controller.py) on real gloo groups: rank 0's
commands run on every rank in order with their collectives, per-rank parts reach their rank, and a worker that fails
or dies fails rank 0's command with Unavailable within seconds instead of hanging it."""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from services.common.errors import Unavailable
from services.trainer.engine.parallel.controller import Controller, serve
from tests.services.trainer.parallel.ranks import RankFailed, run_ranks


class Shard:
    """A stand-in for an engine shard: state per rank, and methods whose collectives meet on every rank."""

    def __init__(self):
        self.rank = dist.get_rank()
        self.total = torch.zeros(1)
        self.calls: list[str] = []

    def add(self, x: float, part: float) -> float:
        self.calls.append("add")
        self.total += x * part
        return float(self.total)

    def summed(self) -> float:
        self.calls.append("summed")
        t = self.total.clone()
        dist.all_reduce(t)
        return float(t)

    def history(self) -> list[str]:
        return list(self.calls)

    def fail_on(self, rank: int) -> str:
        if self.rank == rank:
            raise ValueError("this rank's shard is broken")
        dist.barrier()
        return "ok"

    def die_on(self, rank: int) -> str:
        if self.rank == rank:
            os._exit(3)  # a crash: no exception, the process is gone
        dist.barrier()
        return "ok"


def _drive() -> dict | None:
    target = Shard()
    if dist.get_rank() != 0:
        serve(target)
        return None
    ctl = Controller(target)
    n = ctl.world_size
    added = ctl.run("add", 2.0, per_rank=[float(r + 1) for r in range(n)])
    summed = ctl.run("summed")
    try:
        ctl.run("add", 1.0, per_rank=[1.0] * (n + 1))
        refused = ""
    except ValueError as exc:
        refused = str(exc)
    history = ctl.run("history")
    ctl.stop()
    return {"added": added, "summed": summed, "history": history, "refused": refused}


@pytest.mark.parametrize("world", [2, 4])
def test_commands_run_on_every_rank_in_order(world):
    out = run_ranks(_drive, world)[0]
    assert out["added"] == [2.0 * (r + 1) for r in range(world)]
    assert out["summed"] == [2.0 * world * (world + 1) / 2] * world
    assert out["history"] == [["add", "summed"]] * world
    assert out["refused"] == f"per_rank holds {world + 1} parts for {world} ranks"  # refused before any rank ran it


def _fail(method: str, report: str) -> None:
    target = Shard()
    if dist.get_rank() != 0:
        serve(target)
        return None
    ctl = Controller(target)
    start = time.monotonic()
    outcome = {}
    try:
        ctl.run(method, 1)
    except Unavailable as exc:
        outcome = {"error": str(exc), "seconds": time.monotonic() - start}
    try:
        ctl.run("history")
    except Unavailable as exc:
        outcome["after"] = str(exc)
    Path(report).write_text(json.dumps(outcome))
    return None


@pytest.mark.parametrize("method", ["fail_on", "die_on"])
def test_a_failing_worker_fails_the_command_within_seconds(method, tmp_path):
    report = tmp_path / "rank0.json"
    with pytest.raises(RankFailed):  # the worker left the group on purpose: its exit code is not 0
        run_ranks(_fail, 2, method, str(report), timeout_s=120, kill_on_failure=False)
    outcome = json.loads(report.read_text())
    assert f"a trainer rank failed during {method}" in outcome["error"]
    assert outcome["seconds"] < 30, outcome  # far below the group timeout (120 s): nothing waited for it
    assert "broken" in outcome["after"]  # the group is not used again: the trainer restarts


def _rank0_dies(report: str) -> None:
    target = Shard()
    if dist.get_rank() == 0:
        Controller(target).run("summed")
        os._exit(5)  # rank 0 crashes between commands
    start = time.monotonic()

    def leave(code: int) -> None:
        Path(report).write_text(json.dumps({"code": code, "seconds": time.monotonic() - start}))
        os._exit(code)

    serve(target, exit_on_error=leave)


def test_a_worker_leaves_when_rank_0_dies(tmp_path):
    report = tmp_path / "worker.json"
    with pytest.raises(RankFailed):
        run_ranks(_rank0_dies, 2, str(report), timeout_s=120, kill_on_failure=False)
    outcome = json.loads(report.read_text())
    assert outcome["code"] == 1 and outcome["seconds"] < 30, outcome  # the group timeout is 120 s
