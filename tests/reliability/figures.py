"""The figures each part of the reliability suite records (printed at the end of the run by conftest.py)."""
from __future__ import annotations

FIGURES: dict[str, dict] = {}
