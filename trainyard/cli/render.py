"""Terminal rendering shared by CLI commands: tables, a loss chart, job progress."""
from __future__ import annotations

import math

from rich.console import Console
from rich.table import Table

from trainyard.client import deployment_status_name, format_name, status_name
from trainyard.v1 import scheduler_pb2 as pb

console = Console()
err_console = Console(stderr=True)


def when(ts) -> str:
    return ts.ToDatetime().strftime("%Y-%m-%d %H:%M:%S") if ts.seconds else "-"


def human_bytes(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def datasets_table(rows: list[pb.Dataset]) -> Table:
    t = Table("id", "name", "format", "rows", "size", "created")
    for d in rows:
        t.add_row(d.id, d.name, format_name(d.format), str(d.num_rows), human_bytes(d.size_bytes), when(d.created_at))
    return t


def jobs_table(rows: list[pb.Job]) -> Table:
    t = Table("id", "name", "model", "status", "step", "loss", "created")
    for j in rows:
        loss = j.latest_metrics.get("train/loss")
        t.add_row(j.id, j.spec.display_name, j.spec.base_model, status_name(j.status), f"{j.step}/{j.total_steps}",
                  f"{loss:.4f}" if loss is not None else "-", when(j.created_at))
    return t


def deployments_table(rows: list[pb.Deployment]) -> Table:
    t = Table("name", "id", "status", "base model", "checkpoint", "job", "created")
    for d in rows:
        t.add_row(d.name, d.id, deployment_status_name(d.status), d.base_model, d.checkpoint_id, d.job_id,
                  when(d.created_at))
    return t


def ascii_chart(series: dict[str, list[tuple[int, float]]], width: int = 60, height: int = 12) -> str:
    """A small line chart of one or more (step, value) series, for terminals and logs."""
    points = [p for s in series.values() for p in s]
    if not points:
        return "(no points)"
    xs = [p[0] for p in points]
    ys = [p[1] for p in points if math.isfinite(p[1])]
    x0, x1 = min(xs), max(xs)
    y0, y1 = min(ys), max(ys)
    if y1 == y0:
        y1 = y0 + 1e-9
    grid = [[" "] * width for _ in range(height)]
    marks = "*o+x"
    for i, (_, pts) in enumerate(series.items()):
        for x, y in pts:
            if not math.isfinite(y):
                continue
            col = 0 if x1 == x0 else round((x - x0) / (x1 - x0) * (width - 1))
            row = height - 1 - round((y - y0) / (y1 - y0) * (height - 1))
            grid[row][col] = marks[i % len(marks)]
    lines = []
    for r, row in enumerate(grid):
        label = y1 - (y1 - y0) * r / (height - 1)
        lines.append(f"{label:9.4f} |{''.join(row)}")
    lines.append(" " * 10 + "+" + "-" * width)
    lines.append(" " * 11 + f"step {x0}" + " " * max(1, width - len(f"step {x0}") - len(f"step {x1}")) + f"step {x1}")
    legend = "   ".join(f"{marks[i % len(marks)]} {name}" for i, name in enumerate(series))
    lines.append(" " * 11 + legend)
    return "\n".join(lines)
