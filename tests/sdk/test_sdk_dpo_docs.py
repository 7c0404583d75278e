"""docs/dpo.md's settings table is the declaration's (trainyard/methods/dpo.py): regenerate it with
settings_table() when a setting changes."""
from __future__ import annotations

from pathlib import Path

from trainyard.methods import METHODS
from trainyard.methods.spec import format_value

DOC = Path(__file__).resolve().parents[2] / "docs" / "dpo.md"


def settings_table() -> str:
    rows = ["| Setting | CLI flag | `DpoConfig` field | Default | Allowed | What it does |",
            "|---|---|---|---|---|---|"]
    for f in METHODS["dpo"].fields():
        s = f.setting
        default = "every projection" if f.default == () else format_value(f.default)
        allowed = ", ".join(s.choices) if s.choices else s.bounds_text()
        rows.append(f"| `{f.name}` | `{s.flag}` | `{s.proto}` | {default} | {allowed} | {s.help} |")
    return "\n".join(rows)


def test_the_docs_table_is_the_declaration():
    assert settings_table() in DOC.read_text(), "docs/dpo.md's settings table is stale; paste settings_table()"
