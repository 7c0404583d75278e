"""Real multi-process groups for the distributed tests: run_ranks(fn, n, ...) runs fn on n processes joined in a gloo
process group (torch.distributed, a FileStore rendezvous in a temporary directory) and returns each rank's result.

fn must be a module-level function (the processes import it by name); it runs with one torch thread (a 2-core
machine runs 8 ranks) and returns something torch.save can write. A rank that raises fails the call with its
traceback; the other ranks are killed rather than left waiting in a collective. Processes come from a forkserver
that has imported torch once, so a group of 8 starts in about a second rather than eight torch imports.
"""
from __future__ import annotations

import multiprocessing
import os
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        # torch._dynamo: the first meta-device init (load_pretrained) imports it, ~6 s per process otherwise;
        # torch.distributed.pipelining (it imports torch.export) takes seconds too: once here, not per rank
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "torch.distributed.pipelining",
                                     "models", "services.trainer.engine"])
    return _CTX


def _entry(fn, rank: int, world_size: int, store_path: str, out_dir: str, args: tuple, kwargs: dict,
           env: dict) -> None:
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = Path(out_dir)
    failure = None
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        try:
            result = fn(*args, **kwargs)
        except BaseException:  # noqa: BLE001 - reported to the parent with its traceback
            # stamped before the group is torn down (CLOCK_MONOTONIC is one clock for every process): a rank that
            # failed because this one left fails after it
            failure = f"{time.monotonic_ns()}\n{traceback.format_exc()}"
        if failure is None:
            dist.barrier()  # no rank tears the group down while another is still connecting to it
        dist.destroy_process_group()
        if failure is None:
            torch.save(result, out / f"rank{rank}.pt")
    except BaseException:  # noqa: BLE001
        failure = failure or f"{time.monotonic_ns()}\n{traceback.format_exc()}"
    if failure is not None:
        (out / f"rank{rank}.err").write_text(failure)
        raise SystemExit(1)


class RankFailed(AssertionError):
    pass


def run_ranks(fn, world_size: int, *args, timeout_s: float = 600, env: dict | None = None,
              kill_on_failure: bool = True, **kwargs) -> list:
    """fn(*args, **kwargs) on world_size ranks of a gloo group; each rank's return value, rank order. Inside fn,
    torch.distributed.get_rank() tells the rank. kill_on_failure=False lets the other ranks run on after one fails
    (a test of how they notice it) until they exit or timeout_s passes."""
    import torch

    ctx = _context()
    with tempfile.TemporaryDirectory(prefix="ranks-") as tmp:
        store, out = os.path.join(tmp, "store"), Path(tmp)
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store, tmp, args, kwargs, env or {}),
                             daemon=True) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        try:
            while any(p.is_alive() for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed and kill_on_failure:
                    break
                if time.monotonic() > deadline:
                    raise RankFailed(f"{fn.__name__} on {world_size} ranks did not finish within {timeout_s} s")
                time.sleep(0.05)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(10)
        errors = {r: (out / f"rank{r}.err").read_text().partition("\n") for r in range(world_size)
                  if (out / f"rank{r}.err").exists()}
        if errors:
            first = min(errors, key=lambda r: (int(errors[r][0]), r))
            errors = {r: text for r, (_, _, text) in errors.items()}
            raise RankFailed(f"{fn.__name__}: rank {first} of {world_size} failed "
                             f"(ranks failed: {sorted(errors)}):\n{errors[first]}")
        bad = {r: p.exitcode for r, p in enumerate(procs) if p.exitcode != 0}
        if bad:
            raise RankFailed(f"{fn.__name__}: ranks exited with {bad} and no traceback")
        return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
