"""The CLI's job flags, generated from the methods' declarations (trainyard/methods/): one flag per declared setting
(its flag, aliases, type, choices, and help with the default and bounds), and the way back from a request field the
server names (spec.sft.learning_rate) to the flag a user typed (--lr)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import click
from rich.table import Table

from trainyard.cli.render import human_bytes
from trainyard.methods import BY_PROTO, METHODS, PRIORITY_MAX, PRIORITY_MIN, Method
from trainyard.methods.proto import read
from trainyard.methods.spec import Field, format_value
from trainyard.v1 import scheduler_pb2 as pb

# Request fields outside the settings -> the flags of `trainyard jobs create` / `plan` that set them.
SPEC_FLAGS = {"spec.method": "--method", "spec.base_model": "--model", "spec.dataset_id": "--dataset",
              "spec.resources.trainer_devices": "--trainer-devices",
              "spec.resources.rollout_devices": "--rollout-devices", "spec.priority": "--priority"}


def all_fields() -> dict[str, Field]:
    """Every method's settings by name; methods that share a setting (LoRA, the loop) share its flag."""
    out: dict[str, Field] = {}
    for m in METHODS.values():
        for f in m.fields():
            known = out.setdefault(f.name, f)
            assert _flagged(known) == _flagged(f), f"{f.name} is declared differently by two methods"
    return out


def _flagged(f: Field) -> Field:
    """A setting as its flag sees it: where a method nests it in its proto message (the loop's) does not matter."""
    return dataclasses.replace(f, setting=dataclasses.replace(f.setting, proto=""))


def flag_of(field: str) -> str:
    """The flag that sets a request field ('' when none does)."""
    if field in SPEC_FLAGS:
        return SPEC_FLAGS[field]
    for m in METHODS.values():
        for f in m.fields():
            if field == m.prefix + f.setting.proto:
                return f.setting.flag
    return ""


def _option(f: Field) -> Callable:
    s = f.setting
    if f.type is bool:  # --full-parameter / --no-full-parameter; neither: unset, the server's default applies
        return click.option(f"{s.flag}/--no-{s.flag.removeprefix('--')}", f.name, default=None, help=f.describe())
    kind = click.Choice(s.choices) if s.choices else {int: click.INT, float: click.FLOAT}.get(f.type, click.STRING)
    return click.option(s.flag, *s.aliases, f.name, type=kind, default=None, multiple=f.is_list, help=f.describe())


def method_options(command: Callable) -> Callable:
    """Add --method and every declared setting's flag (default: unset, the server's default applies)."""
    for f in reversed(list(all_fields().values())):
        command = _option(f)(command)
    return click.option(SPEC_FLAGS["spec.method"], type=click.Choice(list(METHODS)), default="sft",
                        show_default=True, help="Job method.")(command)


def job_target(command: Callable) -> Callable:
    """The base model and the dataset of `jobs create` / `jobs plan` (SPEC_FLAGS)."""
    command = click.option(SPEC_FLAGS["spec.dataset_id"], "dataset_id", required=True,
                           help="Dataset id (see `trainyard datasets list`).")(command)
    return click.option(SPEC_FLAGS["spec.base_model"], "base_model", required=True,
                        help="Base model name (see `trainyard models list`).")(command)


def resource_options(command: Callable) -> Callable:
    """The devices a job asks for and its queue priority (docs/resources.md)."""
    command = click.option(SPEC_FLAGS["spec.priority"], "priority", type=int, default=0, show_default=True,
                           help=f"Queue priority, {PRIORITY_MIN}..{PRIORITY_MAX}: higher starts first.")(command)
    command = click.option(SPEC_FLAGS["spec.resources.rollout_devices"], "rollout_devices", type=int, default=None,
                           help="Devices the job samples on (default: the method's).")(command)
    return click.option(SPEC_FLAGS["spec.resources.trainer_devices"], "trainer_devices", type=int, default=None,
                        help="Devices the job trains on, on one worker (default: the method's).")(command)


def settings_from_flags(method: str, values: dict) -> tuple[Method, dict]:
    """The settings the user set (flags left out stay unset); a flag of another method is a usage error."""
    m = METHODS[method]
    own = {f.name for f in m.fields()}
    fields = all_fields()
    given = {k: (tuple(v) if fields[k].is_list else v) for k, v in values.items() if v is not None and v != ()}
    alien = [fields[k].setting.flag for k in given if k not in own]
    if alien:
        raise click.UsageError(f"{', '.join(alien)}: not a setting of {method} jobs")
    return m, given


def plan_table(plan: pb.JobPlan, given: dict) -> Table:
    """A plan as a two-column table: the numbers, then every resolved setting (marked where the user set it)."""
    mem = plan.memory
    t = Table("", "", show_header=False, box=None, pad_edge=False)
    t.add_row("rows", f"{plan.dataset_rows:,}: {plan.train_rows:,} train, {plan.eval_rows:,} eval, "
                      f"{plan.skipped_rows:,} skipped")
    t.add_row("tokens per epoch", f"{plan.tokens_per_epoch:,} ({plan.target_tokens_per_epoch:,} with loss); eval "
                                  f"{plan.eval_target_tokens:,} with loss")
    t.add_row("steps", f"{plan.total_steps:,} ({plan.steps_per_epoch:,} per epoch, {plan.epochs:.2f} epochs)")
    t.add_row("checkpoints", f"{plan.checkpoints:,} (the final one included); {plan.eval_passes:,} eval passes")
    share = plan.trainable_parameters / plan.base_parameters if plan.base_parameters else 0
    t.add_row("trainable", f"{plan.trainable_parameters:,} parameters ({share:.2%} of {plan.base_parameters:,})")
    t.add_row("largest micro-batch", f"{plan.largest_micro_batch_tokens:,} tokens")
    t.add_row(f"memory ({mem.device}, {mem.weights_dtype})", f"about {human_bytes(mem.total_bytes)}")
    held = mem.trainable_bytes + mem.gradient_bytes + mem.optimizer_bytes
    for what, n in (("weights", mem.weights_bytes), ("adapter, gradients, AdamW", held),
                    ("activations", mem.activation_bytes), ("logprob head", mem.logprob_chunk_bytes)):
        t.add_row(f"  {what}", human_bytes(n))
    m = BY_PROTO[plan.spec.method]
    resolved = read(m.settings, getattr(plan.spec, m.config))  # the plan's spec sets every setting
    t.add_row("settings", "")
    for f in m.fields():
        mark = "" if f.name in given else " [dim](default)[/]"
        t.add_row(f"  {f.setting.flag}", format_value(resolved.get(f.name, f.default)) + mark)
    for w in plan.warnings:
        t.add_row("[yellow]warning[/]", w)
    return t
