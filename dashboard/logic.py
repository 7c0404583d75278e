"""What the pages compute, without Streamlit: dataset uploads, tables, the loss chart and the SFT plan.

Kept apart from the page scripts so tests call it directly with a real client.
"""
from __future__ import annotations

import io
import json
import math
import re
from dataclasses import dataclass, field

import altair as alt
import pandas as pd

from trainyard import Client
from trainyard.client import format_name
from trainyard.v1 import scheduler_pb2 as pb

FORMATS = ("auto", "sft_chat", "sft_prompt_completion", "dpo", "rft")
SFT_FORMATS = ("sft_chat", "sft_prompt_completion")
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
                             truncated=report.truncated, num_rows=report.num_rows)
    source = io.BytesIO(data)
    source.name = filename  # the SDK sends it as the dataset's filename
    dataset, dedup = client.upload_dataset(source, name=name, format=fmt)
    return UploadOutcome(filename, dataset=dataset, deduplicated=dedup, num_rows=dataset.num_rows,
                         preview=client.preview_dataset(dataset.id, limit=preview_rows))


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


# -- training plan -----------------------------------------------------------------------------------------------
@dataclass
class SftPlan:
    """The dashboard's SFT settings; defaults are the server's (services/common/methods/sft.py)."""

    lora_rank: int = 16
    lora_alpha: float = 32.0
    learning_rate: float = 1e-4
    epochs: int = 1
    max_steps: int = 0  # 0: run `epochs` passes over the data
    batch_size: int = 4
    gradient_accumulation_steps: int = 1
    checkpoint_every: int = 50
    eval_fraction: float = 0.1
    warmup_steps: int = 0
    lr_scheduler: str = "cosine"
    max_seq_len: int = 2048
    seed: int = 0

    def job_kwargs(self) -> dict:
        """Keyword arguments of Client.create_sft_job; max_steps is sent only when set (it overrides epochs)."""
        kw = dict(vars(self))
        if not self.max_steps:
            del kw["max_steps"]
        return kw

    def split(self, num_rows: int) -> tuple[int, int]:
        """(train rows, eval rows) as the trainer splits them (services/trainer/data.py split_train_eval)."""
        n_eval = 0 if self.eval_fraction <= 0 or num_rows < 2 else \
            min(num_rows - 1, max(1, round(num_rows * self.eval_fraction)))
        return num_rows - n_eval, n_eval

    def total_steps(self, num_rows: int) -> int:
        if self.max_steps:
            return self.max_steps
        train, _ = self.split(num_rows)
        per_step = max(1, self.batch_size * self.gradient_accumulation_steps)
        return math.ceil(train / per_step) * max(self.epochs, 0)

    def summary(self, model: pb.Model, dataset: pb.Dataset) -> list[str]:
        """The plan in sentences (markdown), for the user to approve before launching."""
        train, n_eval = self.split(dataset.num_rows)
        steps = self.total_steps(dataset.num_rows)
        length = f"{self.max_steps} steps" if self.max_steps else \
            f"{self.epochs} epoch{'s' * (self.epochs != 1)}, about {steps} steps"
        checkpoints = (steps - 1) // self.checkpoint_every if steps > 0 and self.checkpoint_every > 0 else 0
        return [
            f"Fine-tune **{md_escape(model.name)}** ({model.architecture}, {model.num_parameters:,} parameters) with a "
            f"LoRA adapter of rank {self.lora_rank} (alpha {self.lora_alpha:g}).",
            f"Data: **{md_escape(dataset.name)}** ({format_name(dataset.format)}): about {train} rows for training and "
            f"{n_eval} held out for the eval loss.",
            f"Length: {length} of {self.batch_size * self.gradient_accumulation_steps} sequences each, learning "
            f"rate {self.learning_rate:g} ({self.lr_scheduler}, {self.warmup_steps} warmup steps).",
            f"Checkpoints: every {self.checkpoint_every} steps ({checkpoints} along the way) plus the final adapter, "
            "which you can deploy and try in the Playground.",
        ]
