"""`trainyard`: the command line for datasets, jobs, deployments and sampling (and operator tasks under `admin`)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click
from google.protobuf import json_format
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TransferSpeedColumn

from trainyard.cli.admin import admin
from trainyard.cli.evaluators import evaluators
from trainyard.cli.local import validate
from trainyard.cli.stack import down, status, up
from trainyard.cli.method_flags import (
    flag_of,
    job_target,
    method_options,
    plan_table,
    resource_options,
    settings_from_flags,
)
from trainyard.cli.render import (
    ascii_chart,
    console,
    datasets_table,
    deployments_table,
    err_console,
    human_bytes,
    jobs_table,
    when,
)
from trainyard.client import DATASET_FORMATS, TERMINAL, Client, format_name, status_name
from trainyard.config import ClientConfig
from trainyard.errors import TrainyardError
from trainyard.v1 import scheduler_pb2 as pb


class Cli(click.Group):
    """Turns every TrainyardError into a readable message and exit status 1; a violation of a request field a flag
    sets names the flag."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except TrainyardError as exc:
            headline = f"{len(exc.violations)} problem(s) found" if exc.violations else exc.message
            err_console.print(f"[bold red]error[/] {exc.code}: {headline}", highlight=False)
            for v in exc.violations[:20]:
                field = f"{flag_of(v.field)} ({v.field})" if flag_of(v.field) else v.field
                where = ", ".join(x for x in (f"row {v.row}" if v.row else "", field) if x)
                err_console.print(f"  - {where}: {v.reason}" if where else f"  - {v.reason}", highlight=False)
            if len(exc.violations) > 20:
                err_console.print(f"  ... and {len(exc.violations) - 20} more", highlight=False)
            sys.exit(1)


@click.group(cls=Cli)
@click.option("--url", envvar="TRAINYARD_URL", help="Scheduler address (host:port).")
@click.option("--rollout-url", envvar="TRAINYARD_ROLLOUT_URL", help="Rollout address (host:port).")
@click.option("--api-key", envvar="TRAINYARD_API_KEY", help="API key (or `trainyard login`).")
@click.pass_context
def cli(ctx, url, rollout_url, api_key):
    """Fine-tune and reinforce open LLMs on your own hardware."""
    ctx.obj = {"url": url, "rollout_url": rollout_url, "api_key": api_key}


def client(ctx) -> Client:
    return Client(**ctx.obj)


def out_json(msg) -> None:
    click.echo(json.dumps(json_format.MessageToDict(msg, preserving_proto_field_name=True), indent=2))


@cli.command()
@click.option("--url", default=None)
@click.option("--rollout-url", default=None)
@click.option("--trainer-url", default=None, help="Trainer address, for the Training API (trainyard.ServiceClient).")
@click.option("--api-key", prompt=True, hide_input=True)
@click.option("--tls-ca-file", default=None, help="CA certificate (PEM) the servers' TLS certificates are signed by.")
@click.option("--tls-client-cert-file", default=None, help="Client certificate (PEM), for mutual TLS.")
@click.option("--tls-client-key-file", default=None, help="The client certificate's private key (PEM).")
def login(url, rollout_url, trainer_url, api_key, tls_ca_file, tls_client_cert_file, tls_client_key_file):
    """Save the server addresses, the API key and the TLS files for later commands."""
    tls = dict(tls_ca_file=tls_ca_file, tls_client_cert_file=tls_client_cert_file,
               tls_client_key_file=tls_client_key_file)
    cfg = ClientConfig.resolve(url, rollout_url, api_key, trainer_url, **tls)
    with Client(cfg.url, cfg.api_key, cfg.rollout_url, **{k: getattr(cfg, k) for k in tls}) as c:
        account = c.whoami()
    path = cfg.save()
    console.print(f"logged in as [bold]{account.name}[/] ({account.id}); saved to {path}")


@cli.command()
@click.pass_context
def whoami(ctx):
    """Show the account the API key belongs to."""
    a = client(ctx).whoami()
    console.print(f"{a.name} ({a.id})")


# -- keys ---------------------------------------------------------------------------------------------------------
@cli.group()
def keys():
    """API keys of your account."""


@keys.command("create")
@click.option("--name", default="")
@click.pass_context
def keys_create(ctx, name):
    resp = client(ctx).create_api_key(name)
    console.print(f"created key {resp.key.id} ({resp.key.name}); store it now, it is not shown again:")
    click.echo(resp.secret)


@keys.command("list")
@click.pass_context
def keys_list(ctx):
    from rich.table import Table

    t = Table("id", "name", "prefix", "created", "revoked")
    for k in client(ctx).list_api_keys():
        t.add_row(k.id, k.name, k.prefix + "...", when(k.created_at), when(k.revoked_at))
    console.print(t)


@keys.command("revoke")
@click.argument("key_id")
@click.pass_context
def keys_revoke(ctx, key_id):
    k = client(ctx).revoke_api_key(key_id)
    console.print(f"revoked {k.id}")


# -- models -------------------------------------------------------------------------------------------------------
@cli.group()
def models():
    """Base models (Hugging Face-format directories)."""


@models.command("import")
@click.argument("path", type=click.Path(file_okay=False))
@click.option("--name", help="Defaults to the directory name.")
@click.pass_context
def models_import(ctx, path, name):
    """Register your own model directory (config.json, safetensors, tokenizer) for your account."""
    p = Path(path).absolute()
    m = client(ctx).import_model(name or p.name, p)
    console.print(f"imported [bold]{m.name}[/]: {m.architecture}, {m.num_layers} layers, hidden {m.hidden_size}, "
                  f"{m.num_parameters:,} parameters")


@models.command("list")
@click.pass_context
def models_list(ctx):
    from rich.table import Table

    t = Table("name", "architecture", "parameters", "layers", "context", "shared", "path")
    for m in client(ctx).list_models():
        t.add_row(m.name, m.architecture, f"{m.num_parameters:,}", str(m.num_layers), str(m.max_position_embeddings),
                  "yes" if m.shared else "", m.path)
    console.print(t)


@models.command("count")
@click.argument("model", metavar="MODEL_DIR_OR_CONFIG")
def models_count(model):
    """Exact parameter counts (total, active per token, by module kind) from config.json alone.

    MODEL_DIR_OR_CONFIG: a model directory, a config.json, or a shipped config name (e.g. deepseek-v3)."""
    from rich.table import Table

    from models.shapes import CONFIGS_DIR, count_parameters, load_config

    try:
        count = count_parameters(load_config(model))
    except ValueError as exc:
        err_console.print(f"[bold red]error[/] {exc}")
        sys.exit(1)
    t = Table("module kind", "parameters", "share", title=f"{model}: {count.architecture}")
    for group, n in sorted(count.by_group.items(), key=lambda kv: -kv[1]):
        t.add_row(group, f"{n:,}", f"{n / count.total:.1%}")
    t.add_row("[bold]total[/]", f"[bold]{count.total:,}[/]", "")
    t.add_row("active per token", f"{count.active:,}", f"{count.active / count.total:.1%}")
    console.print(t)
    shipped = ", ".join(sorted(d.name for d in CONFIGS_DIR.iterdir() if d.is_dir()))
    console.print(f"[dim]shipped configs: {shipped}[/]")


@models.command("build-tiny")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option("--family", type=click.Choice(["qwen3", "qwen3_moe", "deepseek_v3"]), default="qwen3",
              show_default=True)
def models_build_tiny(out_dir, family):
    """Build a tiny model of a family and its tokenizer locally (no download)."""
    from models.tiny import build_tiny_model

    path = build_tiny_model(Path(out_dir), family=family)
    console.print(f"built tiny model at {path}")


# -- datasets -----------------------------------------------------------------------------------------------------
@cli.group()
def datasets():
    """Upload, inspect and delete datasets."""


FORMAT_CHOICE = click.Choice(list(DATASET_FORMATS))


@datasets.command("upload")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--name", default="", help="Defaults to the file name.")
@click.option("--format", "fmt", type=FORMAT_CHOICE, default="auto", show_default=True)
@click.pass_context
def datasets_upload(ctx, file, name, fmt):
    """Upload a JSONL file; every row is validated and nothing is stored if any row is invalid."""
    size = Path(file).stat().st_size
    with Progress(TextColumn("uploading"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                  console=err_console, transient=True) as bar:
        task = bar.add_task("upload", total=size)
        ds, dedup = client(ctx).upload_dataset(file, name=name, format=fmt,
                                               progress=lambda n: bar.advance(task, n))
    note = " (already uploaded: existing dataset returned)" if dedup else ""
    console.print(f"dataset [bold]{ds.id}[/] {ds.name}: {format_name(ds.format)}, {ds.num_rows} rows, "
                  f"{human_bytes(ds.size_bytes)}{note}")


@datasets.command("validate")
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", type=FORMAT_CHOICE, default="auto", show_default=True)
@click.pass_context
def datasets_validate(ctx, file, fmt):
    """Check a JSONL file without storing it; lists every problem."""
    r = client(ctx).validate_dataset(file, format=fmt)
    if r.valid:
        console.print(f"valid: {format_name(r.format)}, {r.num_rows} rows")
        return
    for v in r.violations:
        where = f"row {v.row}" if v.row else "file"
        console.print(f"{where}{', ' + v.field if v.field else ''}: {v.reason}", highlight=False)
    if r.truncated:
        console.print("... more problems not listed")
    sys.exit(1)


@datasets.command("list")
@click.pass_context
def datasets_list(ctx):
    console.print(datasets_table(client(ctx).list_datasets()))


@datasets.command("preview")
@click.argument("dataset_id")
@click.option("--offset", default=0, show_default=True)
@click.option("--limit", default=5, show_default=True)
@click.pass_context
def datasets_preview(ctx, dataset_id, offset, limit):
    for i, row in enumerate(client(ctx).preview_dataset(dataset_id, offset, limit), start=offset):
        click.echo(f"[{i}] {json.dumps(row, ensure_ascii=False)}")


@datasets.command("delete")
@click.argument("dataset_id")
@click.pass_context
def datasets_delete(ctx, dataset_id):
    d = client(ctx).delete_dataset(dataset_id)
    console.print(f"deleted {d.id}")


# -- jobs ---------------------------------------------------------------------------------------------------------
@cli.group()
def jobs():
    """Managed training jobs."""


@jobs.command("create")
@job_target
@click.option("--name", "display_name", default="")
@method_options
@resource_options
@click.option("--plan", "show_plan", is_flag=True, help="Print the plan (see `jobs plan`) before creating the job.")
@click.option("--watch", is_flag=True, help="Follow the job until it ends.")
@click.pass_context
def jobs_create(ctx, base_model, dataset_id, display_name, method, show_plan, watch, trainer_devices,
                rollout_devices, priority, **settings):
    """Create a job (LoRA SFT by default). Flags left out take the server's defaults, shown in each flag's help."""
    m, given = settings_from_flags(method, settings)
    c = client(ctx)
    if show_plan:
        console.print(plan_table(c.plan_job(m.name, base_model, dataset_id, **given), given))
    asked = {k: v for k, v in (("trainer_devices", trainer_devices), ("rollout_devices", rollout_devices),
                               ("priority", priority or None)) if v is not None}  # left out: the server's defaults
    job = c.create_job(m.name, base_model, dataset_id, display_name, **asked, **given)
    console.print(f"job [bold]{job.id}[/] queued")
    if watch:
        _watch(c, job.id)


@jobs.command("plan")
@job_target
@method_options
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def jobs_plan(ctx, base_model, dataset_id, method, as_json, **settings):
    """What `jobs create` with the same flags would run, creating nothing: the same checks, then the resolved
    settings, the train/eval split, tokens, steps, checkpoints, trainable parameters and a memory estimate."""
    m, given = settings_from_flags(method, settings)
    plan = client(ctx).plan_job(m.name, base_model, dataset_id, **given)
    if as_json:
        out_json(plan)
        return
    console.print(f"[bold]{m.title}[/] of {base_model} on {dataset_id}: nothing created")
    console.print(plan_table(plan, given))


@jobs.command("list")
@click.option("--status", type=click.Choice(["queued", "running", "succeeded", "failed", "cancelled"]))
@click.pass_context
def jobs_list(ctx, status):
    console.print(jobs_table(client(ctx).list_jobs(status)))


@jobs.command("get")
@click.argument("job_id")
@click.pass_context
def jobs_get(ctx, job_id):
    out_json(client(ctx).get_job(job_id))


@jobs.command("cancel")
@click.argument("job_id")
@click.pass_context
def jobs_cancel(ctx, job_id):
    j = client(ctx).cancel_job(job_id)
    console.print(f"job {j.id}: {status_name(j.status)}{' (stopping)' if j.status == pb.JOB_STATUS_RUNNING else ''}")


@jobs.command("metrics")
@click.argument("job_id")
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def jobs_metrics(ctx, job_id, as_json):
    points = client(ctx).job_metrics(job_id)
    if as_json:
        click.echo(json.dumps([{"step": p.step, **dict(p.values)} for p in points]))
        return
    click.echo(loss_chart(points))


def loss_chart(points) -> str:
    series = {name: [(p.step, p.values[name]) for p in points if name in p.values]
              for name in ("train/loss", "eval/loss")}
    return ascii_chart({k: v for k, v in series.items() if v})


@jobs.command("watch")
@click.argument("job_id")
@click.pass_context
def jobs_watch(ctx, job_id):
    """Follow a job: progress bar, live loss, log lines; exits 1 if the job does not succeed."""
    _watch(client(ctx), job_id)


def _watch(c: Client, job_id: str) -> None:
    final = None
    with Progress(TextColumn("[bold]{task.fields[status]}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("job", total=None, status="queued", loss="")
        losses: dict[str, float] = {}
        for ev in c.watch_job(job_id):
            if ev.HasField("job"):
                j = ev.job
                bar.update(task, total=j.total_steps or None, completed=j.step, status=status_name(j.status))
                final = j
            elif ev.HasField("metric"):
                losses.update({k: v for k, v in ev.metric.values.items() if k in ("train/loss", "eval/loss")})
                bar.update(task, completed=ev.metric.step,
                           loss="  ".join(f"{k} {v:.4f}" for k, v in sorted(losses.items())))
            else:
                bar.console.print(f"[dim]{when(ev.log.time)}[/] {ev.log.message}", highlight=False)
    if final is None or final.status not in TERMINAL:
        final = c.get_job(job_id)
    console.print(f"job {job_id}: [bold]{status_name(final.status)}[/]" + (f" - {final.error}" if final.error else ""))
    if final.status != pb.JOB_STATUS_SUCCEEDED:
        sys.exit(1)


# -- checkpoints ----------------------------------------------------------------------------------------------------
@cli.group()
def checkpoints():
    """Checkpoints written by jobs."""


@checkpoints.command("list")
@click.option("--job", "job_id", default="")
@click.pass_context
def checkpoints_list(ctx, job_id):
    from rich.table import Table

    t = Table("id", "job", "step", "final", "eval/loss", "files", "created")
    for ck in client(ctx).list_checkpoints(job_id):
        ev = ck.metrics.get("eval/loss")
        t.add_row(ck.id, ck.job_id, str(ck.step), "yes" if ck.final else "", f"{ev:.4f}" if ev is not None else "-",
                  ", ".join(f.path for f in ck.files), when(ck.created_at))
    console.print(t)


@checkpoints.command("download")
@click.argument("checkpoint_id")
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.pass_context
def checkpoints_download(ctx, checkpoint_id, out_dir):
    """Download a checkpoint's files (a PEFT adapter for LoRA jobs)."""
    path = client(ctx).download_checkpoint(checkpoint_id, out_dir)
    console.print(f"wrote {', '.join(sorted(p.name for p in path.iterdir()))} to {path}")


# -- deployments ----------------------------------------------------------------------------------------------------
@cli.group()
def deployments():
    """Serve fine-tuned models on the rollout service."""


@deployments.command("create")
@click.argument("name")
@click.option("--job", "job_id", default="", help="Deploy this job's final checkpoint.")
@click.option("--checkpoint", "checkpoint_id", default="", help="Deploy this checkpoint.")
@click.option("--lineage", default="", help="Serve the current version of this weight lineage (a Training API "
              "session id), hot-loading each new version as it is published.")
@click.pass_context
def deployments_create(ctx, name, job_id, checkpoint_id, lineage):
    """Deploy exactly one of --job, --checkpoint or --lineage under NAME."""
    given = [flag for flag, value in (("--job", job_id), ("--checkpoint", checkpoint_id), ("--lineage", lineage))
             if value]
    if len(given) != 1:
        raise click.UsageError("give exactly one of --job, --checkpoint or --lineage"
                               + (f" (got {', '.join(given)})" if given else ""))
    with console.status(f"deploying {name}..."):
        d = client(ctx).create_deployment(name, job_id=job_id, checkpoint_id=checkpoint_id, lineage=lineage)
    console.print(f"deployment [bold]{d.name}[/] ({d.id}) ready: sample with `trainyard sample {d.name} \"...\"`")


@deployments.command("list")
@click.option("--all", "include_deleted", is_flag=True)
@click.pass_context
def deployments_list(ctx, include_deleted):
    console.print(deployments_table(client(ctx).list_deployments(include_deleted)))


@deployments.command("delete")
@click.argument("name")
@click.pass_context
def deployments_delete(ctx, name):
    d = client(ctx).delete_deployment(name)
    console.print(f"deleted deployment {d.name}")


# -- resources ------------------------------------------------------------------------------------------------------
@cli.command()
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def resources(ctx, as_json):
    """The worker machines' devices (free, or which of your jobs holds each), your quota and your queued jobs."""
    r = client(ctx).list_devices()
    if as_json:
        out_json(r)
        return
    from rich.table import Table

    t = Table(title="devices")
    for col in ("device", "name", "memory", "state", "job", "role"):
        t.add_column(col)
    for d in r.devices:
        state = "free" if d.free else ("held (another account)" if d.held_by_other_account else "held")
        t.add_row(d.id, d.name, human_bytes(d.memory_bytes) if d.memory_bytes else "",
                  state if d.live else f"{state}, machine silent", d.job_id, d.role)
    console.print(t)
    q = r.quota
    limit = lambda n: str(n) if n else "no limit"  # noqa: E731
    console.print(f"devices in use {q.devices_in_use} (quota {limit(q.max_devices)}); jobs queued {q.queued_jobs} "
                  f"(quota {limit(q.max_queued_jobs)})")
    for e in r.queue:
        console.print(f"  {e.job_id}  priority {e.priority}, {e.devices} device(s): {e.wait_reason or 'queued'}")


# -- sampling -------------------------------------------------------------------------------------------------------
@cli.command()
@click.argument("model")
@click.argument("prompt")
@click.option("--chat", is_flag=True, help="Send PROMPT as a user message through the chat template.")
@click.option("--temperature", type=float)
@click.option("--top-p", type=float)
@click.option("--top-k", type=int)
@click.option("--max-tokens", type=int)
@click.option("--stop", multiple=True)
@click.option("--seed", type=int)
@click.option("-n", "n", type=int)
@click.option("--json", "as_json", is_flag=True)
@click.pass_context
def sample(ctx, model, prompt, chat, as_json, stop, **params):
    """Generate from a deployment or a base model."""
    kw = {"messages": [{"role": "user", "content": prompt}]} if chat else {"prompt": prompt}
    resp = client(ctx).sample(model, stop=list(stop) or None, **kw, **params)
    if as_json:
        out_json(resp)
        return
    for i, seq in enumerate(resp.sequences):
        if len(resp.sequences) > 1:
            console.print(f"[bold]--- sample {i} ({seq.finish_reason}, {len(seq.tokens)} tokens)[/]")
        click.echo(seq.text)


@cli.command()
@click.option("--data-dir", type=click.Path(file_okay=False), default=".trainyard-demo", show_default=True)
@click.option("--steps", type=int, default=None, help="SFT steps (default: enough to learn the sample set).")
def demo(data_dir, steps):
    """End to end on embedded defaults: tiny model, services, upload, SFT, deploy, sample."""
    from trainyard.demo import run_demo

    sys.exit(run_demo(Path(data_dir), steps=steps))


cli.add_command(admin)
cli.add_command(evaluators)
cli.add_command(validate)
cli.add_command(up)
cli.add_command(status)
cli.add_command(down)


def main() -> None:
    cli(prog_name="trainyard")


if __name__ == "__main__":
    main()
