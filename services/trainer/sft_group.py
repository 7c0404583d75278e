"""A managed SFT job on a torchrun group: every rank runs run_sft (services/trainer/sft.py) with the same arguments and
the group's parallel layout, and rank 0 hands the run's events to the worker that started the group.

    python -m torch.distributed.run --standalone --nproc-per-node N -m services.trainer.sft_group <spec.json>

The spec (GroupSpec, written by the worker: services/worker/group.py) names the model, the dataset, the job's
hyperparameters, the checkpoint to resume from, the layout and the exchange files under the attempt's group
directory:
  - events.jsonl: rank 0 appends one JSON object per event (event_to_json; the worker reads them back with
    event_from_json), flushed at once, so the worker records each as the in-process run's. A checkpoint is handed
    over by hard-linking its files under outbox/step-NNNNNNN before its event is written (run_sft removes its own
    copy when rank 0 asks for the next event); the worker removes the outbox copy once it has stored it. An error of
    the job itself (a ValueError or a TrainyardError on rank 0: a dataset or checkpoint that does not fit) is written
    as an {"error": ...} line before the rank exits: the job fails with it, as in process.
  - stop: the file the worker creates when its job's stop flag is set (a cancellation, a lost lease); rank 0 looks
    for it before every micro-batch and run_sft shares its decision with every rank.
  - rank<R>.pid: each rank's process id (what an operator, or a test, signals).
A rank that dies (killed, out of memory, a broken collective) ends the group: torchrun stops the other ranks and
exits non-zero, and the worker fails the attempt (services/worker/group.py).
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from services.common.errors import TrainyardError
from services.common.methods.sft import SftHyperparams
from services.trainer.engine.parallel.dims import ParallelDims, join_torchrun_group
from services.trainer.sft import (
    Checkpoint,
    Finished,
    Log,
    Metrics,
    SftCheckpoint,
    SftEvent,
    Started,
    run_sft,
)

EVENTS, STOP, OUTBOX = "events.jsonl", "stop", "outbox"


@dataclass
class GroupSpec:
    model_dir: str
    dataset_path: str
    hyperparams: dict  # SftHyperparams.to_json()
    base_model_name: str
    work_dir: str  # run_sft's work_dir (the job's scratch directory)
    group_dir: str  # the exchange files (module docstring)
    parallel: dict  # ParallelDims fields: the knobs, resolved, and the field_prefix its errors name them with
    resume_step: int = 0
    resume_root: str = ""  # "" = start afresh
    torch_threads: int = 0  # per rank; 0 = torch's default (torchrun sets OMP_NUM_THREADS=1 for N > 1)

    def write(self, path: Path) -> Path:
        path.write_text(json.dumps(asdict(self)))
        return path

    @classmethod
    def read(cls, path: Path) -> GroupSpec:
        return cls(**json.loads(Path(path).read_text()))


class StopFile:
    """A stop flag set by the file's existence (rank 0's; see run_sft's stop)."""

    def __init__(self, path: Path):
        self.path = path

    def is_set(self) -> bool:
        return self.path.exists()


def event_to_json(event: SftEvent) -> dict:
    match event:
        case Log(message, level):
            return {"log": {"message": message, "level": level}}
        case Started(total_steps, info):
            return {"started": {"total_steps": total_steps, "info": info}}
        case Metrics(step, metrics):
            return {"metrics": {"step": step, "metrics": metrics}}
        case Checkpoint(ckpt, final, metrics):
            return {"checkpoint": {"step": ckpt.step, "root": str(ckpt.root), "final": final, "metrics": metrics}}
        case Finished(step, stopped, metrics):
            return {"finished": {"step": step, "stopped": stopped, "metrics": metrics}}
    raise TypeError(f"not an SFT event: {event!r}")


def event_from_json(obj: dict) -> SftEvent:
    (kind, body), = obj.items()
    match kind:
        case "log":
            return Log(**body)
        case "started":
            return Started(**body)
        case "metrics":
            return Metrics(**body)
        case "checkpoint":
            return Checkpoint(SftCheckpoint(body["step"], Path(body["root"])), body["final"], body["metrics"])
        case "finished":
            return Finished(**body)
    raise ValueError(f"not an SFT event: {obj!r}")


def _hand_over(ckpt: SftCheckpoint, outbox: Path) -> SftCheckpoint:
    """The checkpoint's files hard-linked (copied where links fail) under outbox: they outlive run_sft's copy."""
    dest = outbox / ckpt.root.name

    def link(src: str, dst: str) -> None:
        try:
            os.link(src, dst)
        except OSError:
            shutil.copy2(src, dst)

    shutil.copytree(ckpt.root, dest, copy_function=link)
    return SftCheckpoint(ckpt.step, dest)


def run(spec: GroupSpec) -> None:
    """This rank's part of the job (the process group initialized)."""
    group = Path(spec.group_dir)
    rank = dist.get_rank()
    resume = SftCheckpoint(spec.resume_step, Path(spec.resume_root)) if spec.resume_root else None
    events = run_sft(Path(spec.model_dir), Path(spec.dataset_path), SftHyperparams.from_json(spec.hyperparams),
                     stop=StopFile(group / STOP), resume=resume, base_model_name=spec.base_model_name,
                     work_dir=Path(spec.work_dir), parallel=ParallelDims(**spec.parallel))
    if rank != 0:
        for _ in events:  # rank 0 reports; run_sft's collectives keep the ranks in step
            pass
        return
    (group / OUTBOX).mkdir(exist_ok=True)
    with open(group / EVENTS, "a", encoding="utf-8") as out:
        def emit(obj: dict) -> None:
            out.write(json.dumps(obj) + "\n")
            out.flush()

        try:
            for event in events:
                if isinstance(event, Checkpoint):
                    event = Checkpoint(_hand_over(event.checkpoint, group / OUTBOX), event.final, event.metrics)
                emit(event_to_json(event))
        except (ValueError, TrainyardError) as exc:  # the job's own error: the job fails with it, as in process
            emit({"error": f"{type(exc).__name__}: {exc}"})
            raise


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        raise SystemExit("usage: python -m torch.distributed.run ... -m services.trainer.sft_group <spec.json>")
    spec = GroupSpec.read(Path(argv[0]))
    (Path(spec.group_dir) / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    if spec.torch_threads:
        torch.set_num_threads(spec.torch_threads)
    join_torchrun_group()
    try:
        run(spec)
        dist.barrier()  # no rank tears the group down while another still uses it
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
