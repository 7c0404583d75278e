"""`trainyard evaluators`: upload, list and test reward functions / environments (run in the server's sandbox)."""
from __future__ import annotations

import json

import click
from rich.table import Table

from trainyard.cli.render import console, human_bytes, when
from trainyard.client import Client


def _client(ctx) -> Client:
    return Client(**ctx.find_root().obj)


def evaluators_table(rows) -> Table:
    t = Table("name", "version", "kind", "id", "file", "size", "created")
    for e in rows:
        t.add_row(e.name, str(e.version), e.kind, e.id, e.filename, human_bytes(e.size_bytes), when(e.created_at))
    return t


def _short(text: str, width: int = 60) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."


def results_table(resp) -> Table:
    t = Table("row", "completion", "reward", "error")
    for r in resp.results:
        t.add_row(str(r.row), _short(r.completion, 40), f"{r.reward:.4g}" if r.ok else "-", r.error)
    return t


@click.group()
def evaluators():
    """Upload, list and test evaluators: reward_fn(completion, row) or class Environment (reset/step)."""


@evaluators.command("upload")
@click.argument("file", type=click.Path(exists=True))
@click.option("--name", required=True, help="Uploading a name you have already adds its next version.")
@click.pass_context
def evaluators_upload(ctx, file, name):
    """Upload evaluator.py, a .zip / .tar.gz holding it at the top level, or a directory (sent as a .zip)."""
    e = _client(ctx).upload_evaluator(file, name=name)
    console.print(f"evaluator [bold]{e.name}@{e.version}[/] ({e.kind}) {e.id}: {human_bytes(e.size_bytes)}")


@evaluators.command("list")
@click.option("--name", default="", help="Only this name's versions.")
@click.pass_context
def evaluators_list(ctx, name):
    console.print(evaluators_table(_client(ctx).list_evaluators(name)))


@evaluators.command("test")
@click.argument("evaluator", metavar="NAME[@VERSION]|ID")
@click.option("--dataset", "dataset_id", default="", help="Test on this dataset's first --rows rows.")
@click.option("--rows", "num_rows", default=0, help="How many of the dataset's rows (0: the server's default, 10).")
@click.option("--rows-file", type=click.File(), help="JSONL rows to test on instead of a dataset.")
@click.option("--completion", "completions", multiple=True,
              help="The completion for the next row (repeat; rows without one use their own 'completion').")
@click.option("--json", "as_json", is_flag=True, help="Print the response as JSON.")
@click.pass_context
def evaluators_test(ctx, evaluator, dataset_id, num_rows, rows_file, completions, as_json):
    """Run the evaluator in the server's sandbox on sample rows: per-row reward or error, and a summary."""
    if bool(dataset_id) == bool(rows_file):
        raise click.UsageError("give exactly one of --dataset or --rows-file")
    rows = []
    if rows_file:
        for lineno, line in enumerate(rows_file, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except ValueError as exc:
                    raise click.BadParameter(f"line {lineno}: not JSON ({exc})", param_hint="--rows-file")
    resp = _client(ctx).test_evaluator(evaluator, rows=rows, completions=completions, dataset_id=dataset_id,
                                       num_rows=num_rows)
    if as_json:
        from google.protobuf import json_format

        click.echo(json.dumps(json_format.MessageToDict(resp, preserving_proto_field_name=True), indent=2))
        return
    console.print(results_table(resp))
    s = resp.summary
    console.print(f"{resp.evaluator.name}@{resp.evaluator.version}: {s.num_ok}/{s.num_rows} rows scored, "
                  f"{s.num_errors} errors; reward mean {s.reward_mean:.4g} (min {s.reward_min:.4g}, max "
                  f"{s.reward_max:.4g}); {s.elapsed_s:.2f} s", highlight=False)
