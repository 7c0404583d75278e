"""What the pages compute, without Streamlit: dataset uploads, tables, the loss chart, the Train form (from a job
method's declaration) and the plan summary (from PlanJob).

Kept apart from the page scripts so tests call it directly with a real client.
"""
from __future__ import annotations

import io
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field

import altair as alt
import pandas as pd

from trainyard import Client
from trainyard.client import format_name
from trainyard.methods import BY_PROTO, METHODS, Method
from trainyard.methods.proto import read
from trainyard.methods.spec import Field
from trainyard.v1 import scheduler_pb2 as pb

FORMATS = ("auto", "sft_chat", "sft_prompt_completion", "dpo", "rft")
# Request fields outside a method's settings -> the Train page's inputs that set them.
SPEC_LABELS = {"spec.base_model": "Base model", "spec.dataset_id": "Dataset"}
LOSS_METRICS = ("train/loss", "eval/loss")
_MD_SPECIAL = re.compile(r"([\\`*_\[\]<>$~|#])")


def md_escape(text: str) -> str:
    """Text shown as-is inside Streamlit markdown (names and server messages quote fields, JSON and paths)."""
    return _MD_SPECIAL.sub(r"\\\1", text)


# -- datasets ----------------------------------------------------------------------------------------------------
@dataclass
class UploadOutcome:
    """The result of one upload: a stored dataset (with its first rows), or the rows that kept it out."""

    filename: str
    dataset: pb.Dataset | None = None
    deduplicated: bool = False
    preview: list[dict] = field(default_factory=list)
    violations: list[tuple[int, str, str]] = field(default_factory=list)  # (row, field, reason)
    truncated: bool = False  # more violations exist than are listed
    num_rows: int = 0
    mapping: str = ""  # the server's words for the mapping it applied (ShareGPT, Alpaca rows), or ""

    @property
    def ok(self) -> bool:
        return self.dataset is not None


def upload_jsonl(client: Client, data: bytes, filename: str, fmt: str = "auto", name: str = "",
                 preview_rows: int = 5) -> UploadOutcome:
    """Validate the whole file first and store it only if every row is valid.

    ValidateDataset reports every problem with its row and the file's row count, which the page shows; a bad file is
    answered with a row-level table and nothing is stored.
    """
    report = client.validate_dataset(data, format=fmt)
    if not report.valid:
        return UploadOutcome(filename, violations=[(v.row, v.field, v.reason) for v in report.violations],
                             truncated=report.truncated, num_rows=report.num_rows, mapping=report.mapping)
    source = io.BytesIO(data)
    source.name = filename  # the SDK sends it as the dataset's filename
    reply = client.upload_dataset_reply(source, name=name, format=fmt)
    return UploadOutcome(filename, dataset=reply.dataset, deduplicated=reply.deduplicated,
                         num_rows=reply.dataset.num_rows, mapping=reply.mapping,
                         preview=client.preview_dataset(reply.dataset.id, limit=preview_rows))


def token_stats_lines(stats: pb.TokenStats) -> tuple[str, str]:
    """GetTokenStats' answer in two sentences (markdown): the counts, and how the rows fit max_seq_len."""
    over = stats.over_max_seq_len
    summary = (f"**{stats.rows}** rows under **{md_escape(stats.base_model)}**'s tokenizer: "
               f"**{stats.mean_tokens:,.1f}** tokens on average, **{stats.p95_tokens:,}** at the 95th percentile, "
               f"**{stats.max_tokens:,}** at most (counted: {md_escape(stats.counted)}).")
    if not over:
        return summary, f"Every row fits in max_seq_len = {stats.max_seq_len:,} tokens."
    return summary, (f"**{over}** row{'s' * (over != 1)} ({over / stats.rows:.0%}) {'are' if over != 1 else 'is'} "
                     f"longer than max_seq_len = {stats.max_seq_len:,}: a job truncates them, keeping the start; "
                     "raise Max sequence length on the Train page to keep them whole.")


def violations_table(outcome: UploadOutcome) -> pd.DataFrame:
    """One line per problem; row 0 (a problem with the whole file) shows as an empty row cell."""
    return pd.DataFrame([(row or "", fld, reason) for row, fld, reason in outcome.violations],
                        columns=["row", "field", "reason"])


def _cell(value) -> object:
    """A row value as one readable table cell: chat turns as 'role: content' lines, other structures as JSON."""
    if isinstance(value, list) and value and all(isinstance(m, dict) and "role" in m for m in value):
        return " | ".join(f"{m['role']}: {m.get('content', '')}" for m in value)
    if isinstance(value, (dict, list)):
        return json.dumps(value, ensure_ascii=False)
    return value


def preview_frame(rows: list[dict], first_row: int = 1) -> pd.DataFrame:
    frame = pd.DataFrame([{k: _cell(v) for k, v in r.items()} for r in rows])
    frame.index = range(first_row, first_row + len(rows))
    frame.index.name = "row"
    return frame


def when(ts) -> str:
    return f"{ts.ToDatetime():%Y-%m-%d %H:%M:%S}" if ts.seconds else ""


def datasets_frame(datasets: list[pb.Dataset]) -> pd.DataFrame:
    return pd.DataFrame([{"id": d.id, "name": d.name, "format": format_name(d.format), "rows": d.num_rows,
                          "size (KB)": round(d.size_bytes / 1024, 1), "file": d.filename,
                          "created (UTC)": when(d.created_at)} for d in datasets])


def dataset_label(d: pb.Dataset) -> str:
    return f"{d.name} · {format_name(d.format)} · {d.num_rows} rows · {d.id}"


# -- jobs --------------------------------------------------------------------------------------------------------
def metrics_frame(points: list[pb.MetricPoint], names: tuple[str, ...] = LOSS_METRICS) -> pd.DataFrame:
    """Long form (step, metric, value) of the named metrics; eval points are sparser than train points."""
    rows = [{"step": p.step, "metric": k, "value": p.values[k]} for p in points for k in names if k in p.values]
    return pd.DataFrame(rows, columns=["step", "metric", "value"])


def loss_chart(frame: pd.DataFrame) -> alt.Chart:
    base = alt.Chart(frame).encode(
        x=alt.X("step:Q", title="step", axis=alt.Axis(format="d", tickMinStep=1)),
        y=alt.Y("value:Q", title="loss", scale=alt.Scale(zero=False)),
        color=alt.Color("metric:N", title=None, sort=list(LOSS_METRICS)),
        tooltip=["step", "metric", alt.Tooltip("value:Q", format=".4f")])
    return base.mark_line() + base.mark_point(filled=True, size=30)


# -- the Train form and the plan ---------------------------------------------------------------------------------
def field_labels(method: Method) -> dict[str, str]:
    """Request field (e.g. spec.sft.lora.rank) -> the label of the input that sets it."""
    return SPEC_LABELS | {method.prefix + f.setting.proto: f.setting.label for f in method.fields()}


def place_violations(violations, method: Method, slots) -> tuple[dict[str, list[str]], list]:
    """(the reasons by input, for the inputs in slots; the violations no input shows), so each is shown once."""
    names = {method.prefix + f.setting.proto: f.name for f in method.fields()}
    placed: dict[str, list[str]] = defaultdict(list)
    rest = []
    for v in violations:
        name = names.get(v.field, v.field)
        if name in slots:
            placed[name].append(v.reason)
        else:
            rest.append(v)
    return dict(placed), rest


def other_formats_note(datasets: list[pb.Dataset], method: Method) -> str:
    """Which of the account's datasets a method cannot train on, and the methods that can (so none is silently
    missing from the Dataset list); '' when there are none."""
    others: dict[str, list[str]] = defaultdict(list)
    for d in datasets:
        fmt = format_name(d.format)
        if fmt not in method.dataset_formats:
            others[fmt].append(d.name)
    if not others:
        return ""
    parts = []
    for fmt, names in sorted(others.items()):
        takers = [m.title for m in METHODS.values() if fmt in m.dataset_formats and m.trains] or \
            [m.title for m in METHODS.values() if fmt in m.dataset_formats]
        shown = ", ".join(md_escape(n) for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
        parts.append(f"{len(names)} {fmt} dataset{'s' * (len(names) != 1)} ({shown}): choose "
                     + " or ".join(takers))
    return "Not listed for this method: " + "; ".join(parts) + "."


def checkpoint_label(c: pb.Checkpoint) -> str:
    return f"{c.name or c.id} · job {c.job_id or c.session_id} · step {c.step}{' · final' if c.final else ''}"


def float_step(default: float) -> float:
    """The +/- step of a float input: a tenth of the default's order of magnitude (1e-5 for 1e-4, 1 for 32)."""
    return 10.0 ** (math.floor(math.log10(abs(default))) - 1) if default else 0.01


def list_value(text: str) -> tuple[str, ...]:
    """A comma-separated text input as a list of names; empty for the declared default."""
    return tuple(t.strip() for t in text.split(",") if t.strip())


def form_groups(method: Method) -> tuple[list[Field], list[Field]]:
    """(the inputs shown first, the ones under Advanced)."""
    fields = method.fields()
    return [f for f in fields if not f.setting.advanced], [f for f in fields if f.setting.advanced]


def mib(n: int) -> str:
    return f"{n / 2**20:,.1f} MiB" if n < 2**30 else f"{n / 2**30:,.2f} GiB"


def plan_summary(plan: pb.JobPlan, model: pb.Model, dataset: pb.Dataset) -> list[str]:
    """PlanJob's answer in sentences (markdown), for the user to approve before launching; the settings are the
    plan's resolved ones, so defaults the form left alone show as the server will apply them."""
    method = BY_PROTO[plan.spec.method]
    hp = read(method.settings, getattr(plan.spec, method.config))
    mem = plan.memory
    share = plan.trainable_parameters / plan.base_parameters if plan.base_parameters else 0.0
    steps = f"{plan.total_steps} step{'s' * (plan.total_steps != 1)}"
    full = hp.get("full_parameter", False)
    how = "every weight (full-parameter)" if full else \
        f"a LoRA adapter of rank {hp['lora_rank']} (alpha {hp['lora_alpha']:g})"
    how += f", by DPO (beta {hp['beta']:g})" if "beta" in hp else ""
    unit = "pairs" if method.name == "dpo" else "sequences"
    lines = [
        (f"Fine-tune **{md_escape(model.name)}** ({model.architecture}, {plan.base_parameters:,} parameters) with "
         f"{how}: {plan.trainable_parameters:,} trainable parameters ({share:.2%})."),
        (f"Data: **{md_escape(dataset.name)}** ({format_name(dataset.format)}): {plan.train_rows} rows for training "
         f"and {plan.eval_rows} held out for the eval loss ({plan.skipped_rows} skipped); {plan.tokens_per_epoch:,} "
         f"tokens per epoch, {plan.target_tokens_per_epoch:,} of them with loss."),
        (f"Length: {steps} of {hp['batch_size'] * hp['gradient_accumulation_steps']} {unit} each "
         f"({plan.epochs:.2f} epochs of {plan.steps_per_epoch} steps), learning rate {hp['learning_rate']:g} "
         f"({hp['lr_scheduler']}, {hp['warmup_steps']} warmup steps)."),
        (f"Checkpoints: {plan.checkpoints} (every {hp['checkpoint_every']} steps and the final "
         + ("model, a whole model directory to download" if full else
            "adapter, which you can deploy and try in the Playground")
         + f"); {plan.eval_passes} eval passes."),
    ]
    held = mem.trainable_bytes + mem.gradient_bytes + mem.optimizer_bytes
    lines.append(f"Memory: about {mib(mem.total_bytes)} on {mem.device} ({mem.weights_dtype} weights "
                 f"{mib(mem.weights_bytes)}, {'' if full else 'adapter + '}gradients + AdamW {mib(held)}, "
                 "activations of the largest "
                 f"micro-batch ({plan.largest_micro_batch_tokens:,} tokens) {mib(mem.activation_bytes)}, logprob "
                 f"head {mib(mem.logprob_chunk_bytes)}).")
    return lines
