"""`trainyard demo`: the whole platform end to end on embedded defaults (SQLite, filesystem broker, no servers).

Builds the tiny model, starts the services from docker-compose.yml as local processes, uploads a sample dataset,
runs a LoRA SFT job while showing its progress, deploys the adapter, samples from it and prints the loss curve and
before/after answers.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

from rich.console import Console
from rich.panel import Panel
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from trainyard.cli.render import ascii_chart
from trainyard.client import Client, format_name, status_name
from trainyard.localstack import ROOT, Stack
from trainyard.v1 import scheduler_pb2 as pb

DATASET = ROOT / "examples" / "data" / "sft_demo.jsonl"
QUESTIONS = ["What does Trainyard do?", "What is the capital of France?", "What is 12 plus 30?",
             "Which city is the capital of France?"]
# With seed 1 the job holds out two rows for eval loss, the last question above among them: it shows how far a tiny
# model memorizing 18 rows generalizes to a paraphrase it never saw.
SEED = 1
HELD_OUT = {"Which city is the capital of France?"}
SYSTEM = {"role": "system", "content": "You are a helpful assistant."}
SERVICES = ("scheduler", "worker", "trainer", "rollout", "weightsync")

console = Console()


def _answers(c: Client, model: str) -> list[str]:
    return [c.sample(model, messages=[SYSTEM, {"role": "user", "content": q}], temperature=0, max_tokens=32)
            .sequences[0].text.strip() for q in QUESTIONS]


def run_demo(work_dir: Path, steps: int | None = None) -> int:
    from models.tiny import build_tiny_model
    from services.common.auth import create_account
    from services.common.config import TrainyardSettings
    from services.common.db import Database, migrate

    t0 = time.monotonic()
    work_dir = work_dir.absolute()
    if work_dir.exists():
        shutil.rmtree(work_dir)
    stack = Stack(work_dir, database_url=None, broker_url=None,
                  extra_env={"TRAINYARD_TORCH_THREADS": "1", "TRAINYARD_LOG_LEVEL": "WARNING"})
    settings = TrainyardSettings(data_dir=stack.data_dir)
    settings.ensure_dirs()

    console.rule("[bold]Trainyard demo")
    with console.status("building the tiny model and tokenizer (no download)"):
        model_dir = build_tiny_model(stack.data_dir / "models" / "tiny-qwen3")
    console.print(f"1. tiny model built at {model_dir}")
    migrate(settings.database_url)
    db = Database(settings.database_url)
    account, _, api_key = create_account(db, "demo")
    db.dispose()
    console.print(f"2. embedded database {settings.database_url} ready; account [bold]{account.name}[/]")

    try:
        with console.status("starting scheduler, worker, trainer, rollout and weightsync"):
            stack.up(*SERVICES)
        console.print("3. services up: " + ", ".join(f"{n} {stack.url(n)}" for n in SERVICES if n != "worker")
                      + " + Celery worker")
        with Client(url=stack.url("scheduler"), rollout_url=stack.url("rollout"), api_key=api_key) as c:
            return _train_and_compare(c, steps, t0)
    finally:
        with console.status("stopping services"):
            stack.down()
        console.print(f"logs: {stack.log_dir}")


def _train_and_compare(c: Client, steps: int | None, t0: float) -> int:
    ds, _ = c.upload_dataset(DATASET, name="demo-faq")
    console.print(f"4. uploaded {DATASET.name}: {format_name(ds.format)}, {ds.num_rows} rows ({ds.id})")
    first = c.preview_dataset(ds.id, 0, 1)[0]["messages"]
    console.print(f"   first row: user: {first[1]['content']!r} -> assistant: {first[2]['content']!r}")

    before = _answers(c, "tiny-qwen3")
    settings = dict(max_steps=steps or 120, learning_rate=5e-3, batch_size=8, warmup_steps=10, checkpoint_every=20,
                    eval_fraction=0.1, seed=SEED)
    plan = c.plan_job("sft", "tiny-qwen3", ds.id, **settings)
    job = c.create_sft_job("tiny-qwen3", ds.id, "demo-faq-sft", **settings)
    lora = job.spec.sft.lora
    console.print(f"5. SFT job {job.id} queued: LoRA rank {lora.rank}, alpha {lora.alpha:g} (the defaults), "
                  f"{plan.total_steps} steps over {plan.train_rows} rows ({plan.eval_rows} held out), "
                  f"{plan.trainable_parameters:,} trainable parameters, about "
                  f"{plan.memory.total_bytes / 2**20:.0f} MiB")
    with Progress(TextColumn("   [bold]{task.fields[status]}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("job", total=None, status="queued", loss="")
        for ev in c.watch_job(job.id):
            if ev.HasField("job"):
                bar.update(task, total=ev.job.total_steps or None, completed=ev.job.step,
                           status=status_name(ev.job.status))
            elif ev.HasField("metric") and "train/loss" in ev.metric.values:
                bar.update(task, completed=ev.metric.step, loss=f"loss {ev.metric.values['train/loss']:.4f}")
    done = c.get_job(job.id)
    if done.status != pb.JOB_STATUS_SUCCEEDED:
        console.print(f"[red]job {status_name(done.status)}: {done.error}")
        return 1
    points = c.job_metrics(job.id)
    series = {k: [(p.step, p.values[k]) for p in points if k in p.values] for k in ("train/loss", "eval/loss")}
    console.print(Panel(ascii_chart(series), title="loss curve", expand=False))
    train = series["train/loss"]
    console.print(f"   train loss {train[0][1]:.3f} (step {train[0][0]}) -> {train[-1][1]:.3f} (step {train[-1][0]})")

    dep = c.create_deployment("demo-faq", job_id=job.id)
    console.print(f"6. deployed the adapter as [bold]{dep.name}[/] ({dep.checkpoint_id})")
    after = _answers(c, dep.name)
    expected = {m["messages"][1]["content"]: m["messages"][2]["content"] for m in c.preview_dataset(ds.id, 0, 100)}
    table = Table("question", "base model (before)", "fine-tuned (after)", "answer in the data", show_lines=True)
    for q, b, a in zip(QUESTIONS, before, after):
        want = expected[q]
        verdict = "exact" if a == want else "different"
        table.add_row(q + (" [dim](held out)[/]" if q in HELD_OUT else ""), b or "(empty)", a,
                      f"{verdict}: {want}" if a != want else verdict)
    console.print(table)
    console.print(f"demo finished in {time.monotonic() - t0:.0f}s")
    return 0
