"""Commands that run on this machine without the services: model checks."""
from __future__ import annotations

import sys

import click
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from trainyard.cli.render import console, err_console


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.option("--mode", type=click.Choice(["auto", "full", "lora"]), default="auto", show_default=True,
              help="full trains every parameter; auto picks full up to 2B parameters, else lora.")
@click.option("--steps", type=int, default=None, help="Step budget (default 300).")
@click.option("--lr", type=float, default=None, help="Default 5e-3 (lora) or 1e-3 (full).")
@click.option("--target", type=float, default=0.05, show_default=True, help="Mean token loss to reach.")
def validate(model_dir, mode, steps, lr, target):
    """Release gate: the model must memorize a fixed set of 8 sequences (loss < target) within the step budget."""
    from services.trainer.validate import memorization_check

    with Progress(TextColumn("memorizing"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                  TextColumn("{task.fields[loss]}"), TimeElapsedColumn(), console=err_console) as bar:
        task = bar.add_task("steps", total=steps or 300, loss="")
        try:
            result = memorization_check(model_dir, mode=mode, steps=steps, lr=lr, target=target,
                                        on_step=lambda step, loss: bar.update(task, completed=step,
                                                                              loss=f"loss {loss:.4f}"))
        except ValueError as exc:
            err_console.print(f"[bold red]error[/] {exc}")
            sys.exit(1)
    verdict = "[bold green]PASS[/]" if result.passed else "[bold red]FAIL[/]"
    console.print(f"{verdict} {result.architecture} ({result.mode}): loss {result.losses[0]:.4f} -> {result.final_loss:.4f} "
                  f"in {result.steps} steps ({result.seconds:.1f}s); target {target}")
    sys.exit(0 if result.passed else 1)
