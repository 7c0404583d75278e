"""``python -m services.common.migrate``: upgrade the configured database to the latest schema (idempotent)."""
from __future__ import annotations

from services.common.config import TrainyardSettings
from services.common.db import current_revision, migrate


def main() -> None:
    settings = TrainyardSettings()
    settings.ensure_dirs()
    migrate(settings.database_url)
    print(f"database at revision {current_revision(settings.database_url)}")


if __name__ == "__main__":
    main()
