"""Everything stored for one account: its rows in every table and the blobs their manifests name.

Two snapshots of an account taken around another account's calls must be equal: that is "no stored row changed".
Tables are read from the schema's metadata, so a new table with an account_id column is covered without edits.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from sqlalchemy import create_engine, select

from services.common.schema import Base, Job, Model, WeightDelta, WeightVersion


class Snapshots:
    def __init__(self, database_url: str, blob_dir: Path):
        self.engine = create_engine(database_url)
        self.blob_dir = blob_dir

    def close(self) -> None:
        self.engine.dispose()

    def rows(self, account_id: str) -> dict[str, list]:
        """Every row the account owns, by table, as JSON-ready values (sorted by primary key)."""
        out: dict[str, list] = {}
        with self.engine.connect() as conn:
            for table in Base.metadata.sorted_tables:
                if "account_id" in table.c:
                    q = select(table).where(table.c.account_id == account_id)
                elif table.name == Model.__tablename__:
                    q = select(table).where(table.c.scope == account_id)
                elif "job_id" in table.c and table.name.startswith("job_"):
                    q = select(table).where(table.c.job_id.in_(
                        select(Job.id).where(Job.account_id == account_id)))
                elif table.name == WeightDelta.__tablename__:
                    q = select(table).where(table.c.version_id.in_(
                        select(WeightVersion.id).where(WeightVersion.account_id == account_id)))
                else:
                    continue
                rows = conn.execute(q.order_by(*table.primary_key.columns)).mappings().all()
                out[table.name] = [json.loads(json.dumps(dict(r), default=str)) for r in rows]
        return out

    def blobs(self, rows: dict[str, list]) -> dict[str, str]:
        """sha256 -> the sha256 of the bytes now stored under it ("missing" if gone), for every blob named."""
        digests = {r["sha256"] for table in ("datasets", "weight_deltas") for r in rows.get(table, [])}
        for table, columns in (("checkpoints", ("files", "state")), ("weight_versions", ("files",))):
            for r in rows.get(table, []):
                for col in columns:
                    digests.update(f["sha256"] for f in r[col] or [])
        out = {}
        for d in sorted(digests):
            path = self.blob_dir / "sha256" / d[:2] / d[2:4] / d
            out[d] = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "missing"
        return out

    def take(self, account_id: str, with_blobs: bool = False) -> dict:
        rows = self.rows(account_id)
        return {"rows": rows, "blobs": self.blobs(rows) if with_blobs else {}}


def diff(before: dict, after: dict) -> list[str]:
    """What changed between two snapshots, in words (empty when nothing did)."""
    changes = []
    for table in sorted(set(before["rows"]) | set(after["rows"])):
        old = {json.dumps(r, sort_keys=True) for r in before["rows"].get(table, [])}
        new = {json.dumps(r, sort_keys=True) for r in after["rows"].get(table, [])}
        changes += [f"{table}: row removed or changed: {r[:300]}" for r in sorted(old - new)]
        changes += [f"{table}: row added or changed: {r[:300]}" for r in sorted(new - old)]
    for digest, state in before["blobs"].items():
        now = after["blobs"].get(digest, "missing")
        if now != state:
            changes.append(f"blob {digest}: was {state}, now {now}")
    return changes
