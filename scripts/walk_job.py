"""The walk of one managed SFT job through the project's code, measured on the real services.

Starts the services of docker-compose.yml as local processes (trainyard.localstack, embedded SQLite and filesystem
broker), each with a tracer that records every call into the project's own files, and drives one job the way a user
does: `trainyard jobs create ...` (1 step, a checkpoint, no eval; watched untraced), `trainyard deployments create`, then
`trainyard sample`. The walk is the sequence of the request's frames across the processes, in time order: the CLI
commands, the scheduler's CreateJob and CreateDeployment, the worker's job, the rollout's LoadDeployment and Sample.

Only the walk's own layers count as stops -- the CLI and SDK (trainyard/), the scheduler, the worker, the trainer,
its engine (services/trainer/engine/, the checkpoint format included) and the rollout; services/common, models/,
kernels/ and the job-method declarations client and server share (trainyard/methods/) are libraries every layer calls
into and are not followed, nor are module bodies an import runs. For each walk it prints:
  stops         calls that enter another of the walk's files
  files         distinct files entered
  re-entries    calls into a file entered before and since left (the reader jumps back to a file already read)
  climbs        calls from a layer into one listed before it (CLI < scheduler < worker < trainer < engine, and
                deployment: CLI < scheduler < rollout): control going back up, e.g. a callback
and the files in the order they are first entered.

    .venv/bin/python scripts/walk_job.py
"""
from __future__ import annotations

import collections
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

TRACER = r'''
import os, sys, threading
_root = os.environ["TRAINYARD_WALK_ROOT"] + "/"
_log = open(os.path.join(os.environ["TRAINYARD_WALK_DIR"], f"{os.getpid()}.log"), "a", buffering=1)
_seen = {}
def _project(filename):
    hit = _seen.get(filename)
    if hit is None:
        rel = filename[len(_root):] if filename.startswith(_root) else ""
        hit = rel if rel.endswith(".py") and not rel.startswith((".venv", "trainyard/v1/", "scripts/")) else ""
        _seen[filename] = hit
    return hit
def _trace(frame, event, arg):
    if event == "call" or event == "return":
        rel = _project(frame.f_code.co_filename)
        if rel:
            _log.write(f"{threading.get_ident()} {event} {rel} {frame.f_code.co_name}\n")
sys.setprofile(_trace)
threading.setprofile(_trace)
'''

# The walk's layers (first match wins); everything else under the root is a library the walk does not follow (as are
# the declarations client and server share, trainyard/methods/, and module bodies run by an import).
LIBRARIES = ("trainyard/methods/", "trainyard/lazy.py", "trainyard/__init__.py")
LAYERS = (("trainyard/", 0, "CLI / SDK"), ("services/scheduler/", 1, "scheduler"), ("services/worker/", 2, "worker"),
          ("services/trainer/engine/", 4, "engine"), ("services/trainer/", 3, "trainer"),
          ("services/rollout/", 5, "rollout"))
# Where a request's frames begin, per process kind: (file, function).
ENTRIES = {("trainyard/cli/main.py", "main"), ("services/scheduler/servicer.py", "CreateJob"),
           ("services/scheduler/servicer.py", "CreateDeployment"), ("services/worker/app.py", "run_job"),
           ("services/rollout/servicer.py", "LoadDeployment"), ("services/rollout/servicer.py", "Sample")}


def layer(path: str) -> tuple[int, str] | None:
    if path.startswith(LIBRARIES):
        return None
    return next(((rank, name) for prefix, rank, name in LAYERS if path.startswith(prefix)), None)


def segments(log_dir: Path) -> list[list[tuple[str, str, str]]]:
    """Each entry function's frames (event, file, function) from its call to its return, in the order the log files
    were written (one per process; a process's requests in order)."""
    found = []
    for path in sorted(log_dir.glob("*.log"), key=lambda p: p.stat().st_mtime):
        threads: dict[str, list[tuple[str, str, str]]] = collections.defaultdict(list)
        for line in path.read_text().splitlines():
            tid, event, file, func = line.split(" ", 3)
            threads[tid].append((event, file, func))
        for events in threads.values():
            depth, current = 0, None
            for event, file, func in events:
                if current is None:
                    if event == "call" and (file, func) in ENTRIES:
                        current, depth = [], 0
                    else:
                        continue
                current.append((event, file, func))
                depth += 1 if event == "call" else -1
                if depth == 0:
                    found.append(current)
                    current = None
    return found


def measure(frames: list[tuple[str, str, str]]) -> dict:
    """Follow the calls between the walk's files (library frames are skipped, their callees still count from the
    walk file that called into the library)."""
    stack: list[str] = []  # the walk file of each open frame (a library frame repeats its caller's)
    order: list[str] = []
    entered: set[str] = set()
    stops = reentries = climbs = 0
    climbs_seen: list[str] = []
    importing = 0  # frames inside a module body: what an import runs is not the walk
    for event, file, func in frames:
        if event == "return":
            if stack:
                stack.pop()
            importing -= func == "<module>"
            continue
        importing += func == "<module>"
        caller = stack[-1] if stack else None
        here = file if layer(file) and not importing else caller
        stack.append(here)
        if here is None or here == caller:
            continue
        stops += 1
        if here in entered and here not in stack[:-1]:
            reentries += 1
        if caller is not None and layer(here)[0] < layer(caller)[0]:
            climbs += 1
            climbs_seen.append(f"{caller} -> {here}")
        if here not in entered:
            entered.add(here)
            order.append(here)
    return {"stops": stops, "files": len(order), "reentries": reentries, "climbs": climbs, "order": order,
            "climbs_seen": climbs_seen}


def main() -> None:
    from models.tiny import build_tiny_model  # noqa: F401 - the stack builds its tiny models itself
    from trainyard.localstack import Stack

    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        tracer_dir, log_dir = tmp_path / "tracer", tmp_path / "walk"
        tracer_dir.mkdir()
        log_dir.mkdir()
        (tracer_dir / "sitecustomize.py").write_text(TRACER)
        traced = {"PYTHONPATH": f"{tracer_dir}{os.pathsep}{ROOT}", "TRAINYARD_WALK_DIR": str(log_dir),
                  "TRAINYARD_WALK_ROOT": str(ROOT), "TRAINYARD_TORCH_THREADS": "1"}
        stack = Stack(tmp_path / "stack", database_url=None, broker_url=None, extra_env=traced)
        stack.up()
        try:
            env = {**os.environ, **traced, "TRAINYARD_URL": stack.url("scheduler"),
                   "TRAINYARD_ROLLOUT_URL": stack.url("rollout"),
                   "TRAINYARD_CLIENT_CONFIG": str(tmp_path / "client.json")}
            untraced = {k: v for k, v in env.items() if k != "PYTHONPATH"} | {"PYTHONPATH": str(ROOT)}
            key = subprocess.run([sys.executable, "-m", "trainyard.cli.main", "admin", "create-account", "walker",
                                  "--quiet"], env=stack.env_for("scheduler"), cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.strip().splitlines()[-1]
            env["TRAINYARD_API_KEY"] = untraced["TRAINYARD_API_KEY"] = key

            def cli(*args: str, trace: bool = True) -> str:
                out = subprocess.run([sys.executable, "-m", "trainyard.cli.main", *args], env=env if trace else
                                     untraced, cwd=ROOT, capture_output=True, text=True, timeout=600)
                if out.returncode != 0:
                    raise SystemExit(f"trainyard {' '.join(args)} failed:\n{out.stdout}{out.stderr}")
                return out.stdout

            data = ROOT / "examples" / "data" / "sft_demo.jsonl"
            dataset = cli("datasets", "upload", str(data), trace=False).split("dataset ")[1].split()[0]
            for f in log_dir.glob("*.log"):  # start-up and the upload are not the walk (the services keep appending)
                os.truncate(f, 0)
            created = cli("jobs", "create", "--model", "tiny-qwen3", "--dataset", dataset, "--max-steps", "1",
                          "--checkpoint-every", "1", "--eval-fraction", "0")
            job_id = created.split("job ")[1].split()[0]
            cli("jobs", "watch", job_id, trace=False)
            cli("deployments", "create", "walk-dep", "--job", job_id)
            cli("sample", "walk-dep", "What is 2 plus 3?", "--max-tokens", "4")
        finally:
            stack.down()
        found = segments(log_dir)
        print(f"{len(found)} request segments traced\n")
        total = collections.Counter()
        for frames in found:
            event, file, func = frames[0]
            m = measure(frames)
            total.update({k: m[k] for k in ("stops", "reentries", "climbs")})
            print(f"{file}:{func}: {m['stops']} stops in {m['files']} files, {m['reentries']} re-entries, "
                  f"{m['climbs']} climbs")
            for path in m["order"]:
                print(f"    {layer(path)[1]:10s} {path}")
            for climb in m["climbs_seen"]:
                print(f"    climb: {climb}")
        print(f"\nwhole walk: {total['stops']} stops, {total['reentries']} re-entries, {total['climbs']} climbs")


if __name__ == "__main__":
    main()
